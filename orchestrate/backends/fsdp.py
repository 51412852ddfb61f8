"""FSDP2 backend: torch's `fully_shard` per transformer block, then the root.

`fsdp_settings(plan)` is the one place the setup is decided; `render` writes it as fsdp.json and
`setup` applies exactly that dict, so the file the user reads is what runs.

Loading never makes N full copies: the model is built on the meta device, sharded, materialised
empty (`to_empty`), and every rank reads only its own rows of each tensor from the memory-mapped
safetensors into its shard (`orchestrate.loading.weights.load_sharded`): no full copy anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.backends.base import ModelRequest, device_process_group, require_runnable
from orchestrate.backends.safe_load import weights_only_loads
from orchestrate.backends.schedule import apply_hyperparameters, make_scheduler
from orchestrate.backends.sequence_parallel import sequence_parallel_step
from orchestrate.backends.torch_engine import (
    DTYPES,
    TorchEngine,
    adamw_settings,
    check_world_size,
    chosen_for,
    mlp_tiles_step,
    read_client_state,
    run_settings,
    schedule_settings,
    write_client_state,
)
from orchestrate.errors import Problem, UserError
from orchestrate.model.block_classes import block_class_names
from orchestrate.model.fused_kernels import apply_fused_kernels

if TYPE_CHECKING:
    import torch

    from orchestrate.backends.base import ModelBuilder, Objective
    from orchestrate.backends.rank import Rank
    from orchestrate.planner.plan import RunPlan
    from orchestrate.planner.strategy import Sharding, Strategy
    from orchestrate.run.checkpoints import CheckpointMeta

ENGINE_STATE_FILE = "engine_state.json"


def fsdp_settings(plan: RunPlan) -> dict[str, Any]:
    """Everything `setup` applies, as plain JSON-able values. Pure."""
    cand = chosen_for(plan, "fsdp")
    s, hw, train = cand.strategy, plan.hardware, plan.config.train
    require_runnable(BACKEND, s.sharding, "FSDP")
    if s.hybrid_shard:
        mesh = {"shape": [hw.nodes, hw.ranks_per_node], "dim_names": ["replicate", "shard"]}
    else:
        mesh = {"shape": [plan.world_size], "dim_names": ["shard"]}
    blocks = list(plan.shape.block_classes) or block_class_names(plan.shape.model_type)
    mixed = {"param_dtype": DTYPES[s.precision], "reduce_dtype": "float32"} if s.precision in DTYPES else None
    full_shard = s.zero_stage == 3
    settings = {
        **run_settings(plan),
        "mesh": mesh,
        "fully_shard": {
            "block_classes": blocks,  # None: the model's own _no_split_modules (custom code)
            "blocks": plan.shape.num_layers,
            "then_root": True,
            "reshard_after_forward": full_shard,
        },
        "mixed_precision": mixed,
        "cpu_offload": s.offload_params == "cpu",
        "activation_checkpointing": s.activation_checkpointing,
        "micro_batch_size": s.micro_batch_size,
        "gradient_accumulation": cand.gradient_accumulation,
        # Reduce-scatter after every micro-batch, never `set_requires_gradient_sync(False)`: skipping
        # the sync would accumulate a full unsharded fp32 gradient per rank (+4 bytes/param), which
        # the planner's FSDP memory model (sharded gradients, 4P/n) does not count: an OOM on 8 GB.
        "gradient_sync": "every_micro_batch",
        "grad_clip": train.grad_clip,
        "loss_scaling": "dynamic" if s.precision == "fp16" else None,
        "optimizer": adamw_settings(train, fused=hw.has_gpu and s.offload_params == "none"),
        "activation_offload": s.activation_offload,
        "mlp_tiles": s.mlp_tiles,
        "sequence_parallel": s.sequence_parallel,  # the mesh still spans every rank: ZeRO shards over all
        "schedule": schedule_settings(train),
        "seed": train.seed,
    }
    settings["steps"] = _describe(settings)
    return settings


def _describe(st: dict[str, Any]) -> list[str]:
    """The settings as the ordered list of things setup does, for people reading fsdp.json."""
    blocks = ", ".join(st["fully_shard"]["block_classes"] or ["the model's _no_split_modules"])
    mesh = st["mesh"]
    mp = st["mixed_precision"]
    steps = ["build the model on the meta device from model_dir/config.json (no memory)"]
    if st["mlp_tiles"]:
        steps.append(mlp_tiles_step(st["mlp_tiles"], "DeepSpeed's TiledMLP"))
    if st["activation_checkpointing"]:
        steps.append(f"wrap each {blocks} in checkpoint_wrapper (non-reentrant): recompute activations in backward")
    policy = (f"mesh {mesh['shape']} {mesh['dim_names']}, reshard_after_forward={st['fully_shard']['reshard_after_forward']}, "
              + (f"MixedPrecisionPolicy(param_dtype={mp['param_dtype']}, reduce_dtype={mp['reduce_dtype']})" if mp
                 else "no mixed precision (fp32)")
              + (", CPUOffloadPolicy" if st["cpu_offload"] else ""))
    steps += [
        f"fully_shard each of the {st['fully_shard']['blocks']} {blocks} blocks, then the root: {policy}",
        f"to_empty on {'cpu (offloaded shards)' if st['cpu_offload'] else st['device_type']}, recompute rotary/"
        "non-persistent buffers, each rank reads its own rows of every tensor from the safetensors into its shard",
        f"AdamW lr={st['optimizer']['lr']} betas={st['optimizer']['betas']} weight_decay={st['optimizer']['weight_decay']} "
        f"(fused={st['optimizer']['fused']}), warm-up {st['schedule']['warmup_steps']} steps then cosine",
        f"each step: {st['gradient_accumulation']} micro-batch(es) of {st['micro_batch_size']}, gradient reduce-scatter "
        f"on {st['gradient_sync'].replace('_', ' ')}, clip global norm to {st['grad_clip'] or 'off'}"
        + (", dynamic fp16 loss scaling (ShardedGradScaler)" if st["loss_scaling"] else ""),
        *([sequence_parallel_step(st["sequence_parallel"])] if st["sequence_parallel"] > 1 else []),
    ]
    return steps


def _dtype(name: str | None):
    import torch

    return getattr(torch, name) if name else None


def _shardable(blocks: list[tuple[str, Any]], layout) -> list[bool]:
    """Per block: whether it may be its own FSDP unit. Not when it holds a weight tied to one outside
    it (a custom model naming its embeddings a block, with a tied head): `fully_shard` would swap the
    shared Parameter for a DTensor in the block only and the tie would come apart. Such a block stays
    in the root unit, where the tie survives (as GPT-2's wte / lm_head do)."""
    def split(prefix: str) -> bool:
        return any(len({name.startswith(prefix) for name in group}) == 2 for group in layout.tie_groups)

    return [not split(name + ".") for name, _ in blocks]


class FSDPEngine(TorchEngine):
    """TrainEngine over a `fully_shard`ed model.

    Every micro-batch's backward reduce-scatters into the sharded .grad (settings' gradient_sync),
    so the default `_gradient_sync` applies; mixed precision comes from the MixedPrecisionPolicy.
    """

    def __init__(self, plan: RunPlan, *args: Any) -> None:
        super().__init__(*args)
        self.plan = plan

    def _global_norm(self, norm: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def model_state(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Gathered shard by shard into rank 0's CPU memory; the other ranks get an empty dict.
        return get_model_state_dict(self.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only))

    def save_hf_model(self, out_dir: Path) -> None:
        import torch.distributed as dist

        from orchestrate.backends.hf_io import save_hf_dir

        state = self.model_state()
        if self.rank.rank == 0:
            save_hf_dir(state, self.hf_config, Path(out_dir), self.layout)
        dist.barrier()

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # A frozen base is left out of the checkpoint and re-read from model_dir (not strict: the frozen
        # keys are absent on purpose; dcp.load fails on any trainable key it lacks).
        return StateDictOptions(ignore_frozen_params=self.frozen, strict=not self.frozen)

    def _engine_state(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler else None}

    def save_checkpoint(self, ckpt_dir: Path, client_state: dict[str, Any]) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        ckpt_dir = Path(ckpt_dir)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        # A tied weight (GPT-2's lm_head = wte) is one Parameter under two keys; DCP would write it
        # twice (+150 MB for GPT-2 small). Only the first key of each tie group is saved.
        model_sd = {k: v for k, v in model_sd.items() if k not in self.layout.aliases}
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt_dir))
        if self.rank.rank == 0:  # scheduler and scaler state are identical on every rank
            (ckpt_dir / ENGINE_STATE_FILE).write_text(json.dumps(self._engine_state(), indent=1))
            write_client_state(ckpt_dir, client_state)
        dist.barrier()

    def load_checkpoint(self, ckpt_dir: Path) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        ckpt_dir = Path(ckpt_dir)
        # The shapes DCP loads into, sharded for this world size: DCP reshards whatever wrote it.
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        aliases = {alias: group[0] for group in self.layout.tie_groups for alias in group[1:]}
        state = {"model": {k: v for k, v in model_sd.items() if k not in aliases}, "optim": optim_sd}
        with weights_only_loads():  # DCP unpickles non-tensor entries (param_groups) itself
            dcp.load(state, checkpoint_id=str(ckpt_dir))
        model_sd = {**state["model"], **{alias: state["model"][key] for alias, key in aliases.items()}}
        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=state["optim"],
                       options=self._options())
        engine = json.loads((ckpt_dir / ENGINE_STATE_FILE).read_text())
        self.scheduler.load_state_dict(engine["scheduler"])
        apply_hyperparameters(self.scheduler, self.plan.config.train)
        if self.scaler and engine["scaler"]:
            self.scaler.load_state_dict(engine["scaler"])
        return read_client_state(ckpt_dir)


def check_device(settings: dict[str, Any], device: torch.device) -> None:
    """Refuse what this device cannot run, before any collective starts."""
    if settings["cpu_offload"] and device.type == "cpu":
        raise UserError("FSDP CPU offload needs a GPU", [Problem(
            "strategy.offload_params", "CPUOffloadPolicy moves shards between an accelerator and the CPU; "
                                       "this worker runs on the CPU already",
            "set strategy.offload: none (the planner never picks offload on CPU-only machines)")])


class FSDPBackend:
    name = "fsdp"
    zero_stages = (2, 3)
    tie_break = 1
    priced_as = "fsdp"
    # Each knob trained under this engine on gloo ranks; adamw8bit gets DTensor parameters here and fails
    # (docs/measurements.md#backends); fused_kernels as under DDP
    knobs = frozenset({"loss_chunks", "activation_offload", "fused_kernels", "mlp_tiles", "sequence_parallel"})

    def shards_parameters(self, sharding: Sharding) -> bool:
        return True  # both stages shard the parameters (DTensor); shard-grad-op only keeps them gathered

    def problems(self, sharding: Sharding) -> list[Problem]:
        out, stage = [], sharding.zero_stage
        if stage not in (2, 3):
            out.append(Problem("strategy.zero_stage", f"FSDP2 has no stage {stage}: it implements 3 (full shard) "
                               "and 2 (shard grads/optimizer)", "use zero_stage 3 (full shard) or 2 (shard-grad-op)"))
        offload = (sharding.offload_optimizer, sharding.offload_params)
        if "nvme" in offload:
            out.append(Problem("strategy.offload", "FSDP2 offloads to CPU only", "use offload: cpu, or backend deepspeed"))
        elif offload not in (("none", "none"), ("cpu", "cpu")):
            out.append(Problem("strategy.offload_params", "FSDP2's CPUOffloadPolicy offloads parameters, gradients "
                               f"and optimizer state together; got offload={offload[0]}, offload_params={offload[1]}",
                               "set offload: cpu with offload_params: true (or auto), or offload: none, or use "
                               "backend deepspeed for other mixes"))
        elif offload == ("cpu", "cpu") and stage != 3:
            out.append(Problem("strategy.offload_params", "only FSDP full shard (stage 3) offloads parameters",
                               "set zero_stage: 3"))
        if sharding.hybrid_shard and stage != 3:
            out.append(Problem("strategy.zero_stage", "hybrid shard is full sharding inside a node", "set zero_stage: 3"))
        return out

    def reads_weights(self, plan: RunPlan) -> bool:
        return True  # rank 0 (or each rank) fills the sharded model from the files

    def process_group(self, plan: RunPlan) -> str:
        strategy = plan.strategy
        if plan.hardware.has_gpu and strategy.offload_params == "cpu":
            # Offloaded shards, gradients and the clip norm are CPU tensors: their collectives need
            # a CPU backend next to nccl (torchtitan and accelerate do the same).
            return "cuda:nccl,cpu:gloo"
        return device_process_group(plan)

    def resume_conflicts(self, saved: dict[str, Any], strategy: Strategy) -> list[Problem]:
        return []  # DCP reshards to any world size and sharding layout natively

    def full_state_dict(self, ckpt_dir: Path, meta: CheckpointMeta) -> dict[str, torch.Tensor]:
        """The "model" entries of the DCP checkpoint, read in one process (optimizer shards untouched)."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        reader = dcp.FileSystemReader(str(ckpt_dir))
        prefix = "model."  # FSDPEngine.save_checkpoint saves {"model": ..., "optim": ...}
        state = {key[len(prefix):]: torch.empty(md.size, dtype=md.properties.dtype)
                 for key, md in reader.read_metadata().state_dict_metadata.items()
                 if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
        dcp.load({"model": state}, storage_reader=reader, no_dist=True)
        return state

    def render(self, plan: RunPlan) -> dict[str, str]:
        return {"fsdp.json": json.dumps(fsdp_settings(plan), indent=2) + "\n"}

    def setup(self, plan: RunPlan, rank: Rank, model_dir: Path, objective: Objective,
              build_model: ModelBuilder) -> FSDPEngine:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        from orchestrate.backends import hf_io
        from orchestrate.loading.tiled_mlp import tile_mlps

        st = fsdp_settings(plan)
        check_device(st, rank.device)
        if st["cpu_offload"] and "gloo" not in str(dist.get_backend()):
            # process_group() asked the worker for a gloo part; a process group made elsewhere may lack it.
            raise RuntimeError("FSDP CPU offload needs the process group initialised as 'cuda:nccl,cpu:gloo', "
                               f"not {dist.get_backend()!r}")
        check_world_size(st, rank)
        torch.manual_seed(st["seed"])
        # On the meta device (a Hugging Face model), filled after fully_shard; your own module is built for
        # real (seeded alike on every rank) and fully_shard keeps each rank's shard of those weights.
        built = build_model(ModelRequest(
            "sharded", rank.device, rank.rank, model_dir, cpu_offload=st["cpu_offload"]))
        model, hf_config, layout = built.model, built.config, built.layout
        apply_fused_kernels(plan, model, rank.device.type)  # before checkpoint wrappers and fully_shard
        tile_mlps(model, st["mlp_tiles"])
        # A module of yours names its blocks in its shape (detected or strategy.wrap); without any it is one
        # FSDP unit (the root). A Hugging Face model's come from its family or its _no_split_modules.
        classes = st["fully_shard"]["block_classes"] or ([] if plan.shape.task == "custom" else
                                                         hf_io.model_block_class_names(model, hf_config.model_type))
        keep = _shardable(hf_io.find_blocks(model, classes), layout) if classes else []
        if st["activation_checkpointing"]:
            blocks = hf_io.checkpoint_blocks(model, classes)  # the wrappers, in find_blocks order
        else:
            blocks = [m for _, m in hf_io.find_blocks(model, classes)] if classes else []
        blocks = [block for block, ok in zip(blocks, keep, strict=True) if ok]

        mesh = init_device_mesh(st["device_type"], tuple(st["mesh"]["shape"]),
                                mesh_dim_names=tuple(st["mesh"]["dim_names"]))
        mp = st["mixed_precision"]
        shard_kwargs = {
            "mesh": mesh,
            "reshard_after_forward": st["fully_shard"]["reshard_after_forward"],
            "mp_policy": MixedPrecisionPolicy(param_dtype=_dtype(mp["param_dtype"]), reduce_dtype=_dtype(mp["reduce_dtype"]))
            if mp else MixedPrecisionPolicy(),
            "offload_policy": CPUOffloadPolicy() if st["cpu_offload"] else OffloadPolicy(),
        }
        for block in blocks:
            fully_shard(block, **shard_kwargs)
        fully_shard(model, **shard_kwargs)

        if built.fill is not None:  # allocate the shards and read this rank's rows (or rank 0's broadcast)
            built.fill(model)
        del built
        hf_io.move_buffers(model, rank.device)  # buffers are not sharded: they stay on the compute device
        # Train mode before any forward: bitsandbytes repacks a 4-bit weight in place for its CPU kernel on
        # an eval-mode no-grad forward (Linear4bit.forward), which would break the sharded parameter.
        model.train()

        opt = st["optimizer"]
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                      weight_decay=opt["weight_decay"], fused=opt["fused"])
        scheduler = make_scheduler(optimizer, plan.config.train)
        scaler = None
        if st["loss_scaling"]:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            # Sharded: the inf/nan check is all-reduced, so every rank skips the same steps.
            scaler = ShardedGradScaler(device=rank.device.type)
        return FSDPEngine(plan, model, optimizer, scheduler, scaler, st, hf_config, layout, rank, model_dir, objective)


BACKEND = FSDPBackend()
