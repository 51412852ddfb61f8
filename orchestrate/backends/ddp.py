"""DDP backend: torch DistributedDataParallel, plain data parallel (ZeRO stage 0).

Each rank holds the whole model, gradients and optimizer state, which DDP needs anyway; it is
allocated on the rank's device and filled tensor by tensor (`orchestrate.loading.weights`), so no
rank holds a second, CPU copy while loading. `ddp_settings(plan)` is the one
place the setup is decided: `render` writes it as ddp.json and `setup` applies that dict.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.backends.base import (
    ModelRequest,
    device_process_group,
    require_runnable,
    trainable_state,
)
from orchestrate.backends.schedule import apply_hyperparameters, make_scheduler
from orchestrate.backends.sequence_parallel import sequence_parallel_step
from orchestrate.backends.torch_engine import (
    DTYPES,
    TorchEngine,
    adamw_settings,
    check_world_size,
    chosen_for,
    make_optimizer,
    mlp_tiles_step,
    read_client_state,
    run_settings,
    schedule_settings,
    write_client_state,
)
from orchestrate.errors import Problem
from orchestrate.model.block_classes import block_class_names
from orchestrate.model.fused_kernels import apply_fused_kernels

if TYPE_CHECKING:
    import torch

    from orchestrate.backends.base import ModelBuilder, Objective
    from orchestrate.backends.rank import Rank
    from orchestrate.planner.plan import RunPlan
    from orchestrate.planner.strategy import Sharding, Strategy
    from orchestrate.run.checkpoints import CheckpointMeta

TRAINER_STATE_FILE = "trainer_state.pt"


def ddp_settings(plan: RunPlan) -> dict[str, Any]:
    """Everything `setup` applies, as plain JSON-able values. Pure."""
    cand = chosen_for(plan, "ddp")
    s, hw, train = cand.strategy, plan.hardware, plan.config.train
    require_runnable(BACKEND, s.sharding, "DDP")
    settings = {
        **run_settings(plan),
        # fp32 weights and optimizer; forward/backward under autocast to the precision's dtype.
        "autocast_dtype": DTYPES.get(s.precision),
        "loss_scaling": "dynamic" if s.precision == "fp16" else None,
        "activation_checkpointing": s.activation_checkpointing,
        "block_classes": list(plan.shape.block_classes) or block_class_names(plan.shape.model_type),
        "micro_batch_size": s.micro_batch_size,
        "gradient_accumulation": cand.gradient_accumulation,
        "gradient_sync": "last_micro_batch",  # no_sync() on the others: gradients are replicated anyway
        "grad_clip": train.grad_clip,
        "optimizer": adamw_settings(train, fused=hw.has_gpu, name=s.optimizer),
        "activation_offload": s.activation_offload,
        "embedding_offload": s.embedding_offload,  # the frozen input embedding in host memory (planner/knobs.py)
        "mlp_tiles": s.mlp_tiles,
        "schedule": schedule_settings(train),
        "seed": train.seed,
    }
    blocks = ", ".join(settings["block_classes"] or ["the model's _no_split_modules"])
    settings["steps"] = [
        "every rank builds the model on the meta device, allocates it on its device (fp32) and fills it "
        "tensor by tensor from the safetensors files",
        *([mlp_tiles_step(s.mlp_tiles, "a torch checkpoint per slice")] if s.mlp_tiles else []),
        *([f"wrap each {blocks} in checkpoint_wrapper (non-reentrant)"] if s.activation_checkpointing else []),
        *(["the input embedding is allocated and filled in CPU memory and stays there: each lookup runs on the "
           "CPU, its rows are copied to the device; DDP leaves it out of its broadcast"] if s.embedding_offload else []),
        "wrap in DistributedDataParallel (rank 0's weights broadcast at construction; one rank trains the "
        "model as it is: no gradient buckets)",
        *([sequence_parallel_step(s.sequence_parallel)] if s.sequence_parallel > 1 else []),
        f"each step: {cand.gradient_accumulation} micro-batch(es) of {s.micro_batch_size}"
        + (f" under autocast({settings['autocast_dtype']})" if settings["autocast_dtype"] else "")
        + f", gradients all-reduced on the last one only, clip global norm to {train.grad_clip or 'off'}"
        + (", dynamic fp16 loss scaling (GradScaler)" if settings["loss_scaling"] else ""),
    ]
    return settings


class DDPEngine(TorchEngine):
    """TrainEngine over a DistributedDataParallel model (on one rank: single_rank.SingleRank)."""

    def __init__(self, plan: RunPlan, *args: Any) -> None:
        super().__init__(*args)
        self.plan = plan

    def _forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch

        dtype = self.settings["autocast_dtype"]
        with torch.autocast(self.rank.device.type, dtype=getattr(torch, dtype) if dtype else None, enabled=bool(dtype)):
            return super()._forward_loss(batch)

    def _gradient_sync(self, index: int, count: int) -> contextlib.AbstractContextManager:
        # DDP all-reduces in backward; skip that on all but the last micro-batch (grads accumulate locally).
        return self.model.no_sync() if index < count - 1 else contextlib.nullcontext()

    def model_state(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        if self.rank.rank != 0:  # every rank holds the same weights
            return {}
        module = self.model.module
        return trainable_state(module) if trainable_only else module.state_dict()

    def save_hf_model(self, out_dir: Path) -> None:
        import torch.distributed as dist

        from orchestrate.backends.hf_io import save_hf_dir

        if self.rank.rank == 0:
            save_hf_dir(self.model_state(), self.hf_config, Path(out_dir), self.layout)
        dist.barrier()

    def save_checkpoint(self, ckpt_dir: Path, client_state: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        ckpt_dir = Path(ckpt_dir)
        if self.rank.rank == 0:  # replicated state: one copy is the whole checkpoint
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            # A frozen base is re-read from model_dir on resume: only what trains is saved.
            state = {"model": self.model_state(trainable_only=self.frozen), "optimizer": self.optimizer.state_dict(),
                     "scheduler": self.scheduler.state_dict(),
                     "scaler": self.scaler.state_dict() if self.scaler else None}
            tmp = ckpt_dir / (TRAINER_STATE_FILE + ".tmp")
            torch.save(state, tmp)
            tmp.replace(ckpt_dir / TRAINER_STATE_FILE)
            write_client_state(ckpt_dir, client_state)
        dist.barrier()

    def load_checkpoint(self, ckpt_dir: Path) -> dict[str, Any]:
        import torch

        ckpt_dir = Path(ckpt_dir)
        # weights_only: tensors and plain containers only, nothing a checkpoint file could execute.
        state = torch.load(ckpt_dir / TRAINER_STATE_FILE, map_location=self.rank.device, weights_only=True)
        module = self.model.module
        if self.frozen:  # what trains only (see save_checkpoint); every one of those must be there
            result = module.load_state_dict(state["model"], strict=False)
            if result.unexpected_keys or set(trainable_state(module)) - set(state["model"]):
                raise RuntimeError(f"checkpoint adapters do not match the model: {result.unexpected_keys[:3]}")
        else:
            module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        apply_hyperparameters(self.scheduler, self.plan.config.train)
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        return read_client_state(ckpt_dir)


class DDPBackend:
    name = "ddp"
    zero_stages = (0,)
    tie_break = 0
    priced_as = "ddp"
    # Each knob trained under this engine on gloo ranks (docs/measurements.md#backends); fused_kernels applied
    # between build and wrap (its numerics are checked on a GPU only)
    knobs = frozenset({"loss_chunks", "activation_offload", "adamw8bit", "embedding_offload", "fused_kernels",
                       "sequence_parallel", "mlp_tiles"})

    def shards_parameters(self, sharding: Sharding) -> bool:
        return False  # every rank holds every parameter

    def problems(self, sharding: Sharding) -> list[Problem]:
        out = []
        if sharding.zero_stage != 0:
            out.append(Problem("strategy.zero_stage", f"backend ddp replicates everything (stage 0), not stage "
                               f"{sharding.zero_stage}", "use backend deepspeed or fsdp for sharding, or zero_stage: 0"))
        if sharding.offload_optimizer != "none" or sharding.offload_params != "none":
            out.append(Problem("strategy.offload", "DDP cannot offload", "use backend deepspeed or fsdp"))
        if sharding.hybrid_shard:
            out.append(Problem("strategy", "hybrid shard is an FSDP2 mode", "use backend fsdp"))
        return out

    def reads_weights(self, plan: RunPlan) -> bool:
        # Every rank holds the whole model: from its config, each builds it under the same seed (what
        # rank 0 would have saved; DDP broadcasts rank 0's values at construction anyway).
        return False

    def process_group(self, plan: RunPlan) -> str:
        return device_process_group(plan)

    def resume_conflicts(self, saved: dict[str, Any], strategy: Strategy) -> list[Problem]:
        return []  # the full state in trainer_state.pt loads on any world size

    def full_state_dict(self, ckpt_dir: Path, meta: CheckpointMeta) -> dict[str, torch.Tensor]:
        import torch

        # Memory-mapped: the optimizer state next to it is never read. A LoRA run's: the adapters only.
        return torch.load(Path(ckpt_dir) / TRAINER_STATE_FILE, map_location="cpu", weights_only=True,
                          mmap=True)["model"]

    def render(self, plan: RunPlan) -> dict[str, str]:
        return {"ddp.json": json.dumps(ddp_settings(plan), indent=2) + "\n"}

    def setup(self, plan: RunPlan, rank: Rank, model_dir: Path, objective: Objective,
              build_model: ModelBuilder) -> DDPEngine:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        from orchestrate.backends import hf_io, single_rank
        from orchestrate.loading.host_embedding import host_names, route_lookups, to_device_keeping_embedding
        from orchestrate.loading.tiled_mlp import tile_mlps

        st = ddp_settings(plan)
        check_world_size(st, rank)
        torch.manual_seed(st["seed"])
        # Allocated on this rank's device and filled one tensor at a time (loading/weights.py): no full fp32
        # copy per rank in CPU RAM on the way to the GPU. fp32: DDP trains fp32 weights.
        built = build_model(ModelRequest(
            "replicated", rank.device, rank.rank, model_dir, torch.float32, embedding_offload=st["embedding_offload"]))
        model = built.model
        apply_fused_kernels(plan, model, rank.device.type)  # before checkpoint wrappers hide the blocks' modules
        tile_mlps(model, st["mlp_tiles"], repeated_accumulation=False)  # DDP's reducer: one hook per backward
        if st["activation_checkpointing"]:
            classes = st["block_classes"] or hf_io.model_block_class_names(model, plan.shape.model_type)
            hf_io.checkpoint_blocks(model, classes)
        if st["embedding_offload"]:  # the frozen input embedding stays on the CPU (loading/host_embedding.py)
            to_device_keeping_embedding(model, rank.device)
            route_lookups(model, rank.device)
            # DDP refuses parameters on two device types and broadcasts every one at construction (NCCL cannot
            # send CPU tensors): leave the table out; every rank read the same bytes, and frozen, it has no
            # gradient to reduce (torch/nn/parallel/distributed.py parameters_to_ignore).
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(host_names(model, True)))
        else:
            model.to(rank.device)
        on_gpu = rank.device.type == "cuda"
        ddp = single_rank.wrap(model, rank.device, rank.world_size)

        optimizer = make_optimizer([p for p in ddp.parameters() if p.requires_grad], st["optimizer"], on_gpu)
        scheduler = make_scheduler(optimizer, plan.config.train)
        scaler = torch.amp.GradScaler(rank.device.type) if st["loss_scaling"] else None
        return DDPEngine(plan, ddp, optimizer, scheduler, scaler, st, built.config, built.layout, rank, model_dir,
                         objective)


BACKEND = DDPBackend()
