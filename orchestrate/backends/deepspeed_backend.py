"""The DeepSpeed backend: ZeRO stages 0-3 with optional CPU/NVMe offload of optimizer and parameters.

`render` (pure) lives in `deepspeed_render.py`; this file is the worker side: it builds the model,
optimizer and schedule, wraps them with `deepspeed.initialize`, and adapts the DeepSpeed engine to
orchestrate's `TrainEngine`. deepspeed itself is imported only inside `setup`, so registering the
backend (and rendering) works where deepspeed is not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.backends.base import (
    ModelRequest,
    StepResult,
    begin_step,
    device_process_group,
    has_frozen_parameters,
)
from orchestrate.backends.deepspeed_render import engine_config, render, sharding_problems
from orchestrate.backends.safe_load import deepspeed_checkpoint_classes, weights_only_loads
from orchestrate.backends.schedule import apply_hyperparameters, make_scheduler
from orchestrate.errors import Problem
from orchestrate.model.fused_kernels import apply_fused_kernels
from orchestrate.run.resume_rules import EXPORT_FIX

if TYPE_CHECKING:
    import torch

    from orchestrate.backends.base import ModelBuilder, Objective
    from orchestrate.backends.rank import Rank
    from orchestrate.planner.plan import RunPlan
    from orchestrate.planner.strategy import Sharding, Strategy
    from orchestrate.run.checkpoints import CheckpointMeta

_LOAD_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""Parameter dtype of a replicated (ZeRO-0/1/2) load per training precision."""
_CKPT_TAG = "deepspeed"
"""Sub-directory of a checkpoint directory that holds DeepSpeed's files (`save_checkpoint(tag=...)`)."""
_OPTIM_FILES = "*_optim_states.pt"
"""One file per data-parallel rank of a ZeRO checkpoint: their count is the saved DP size."""
_UNIVERSAL_DIR = "universal"
"""Sub-directory of a checkpoint directory for its universal (DP-size independent) conversion."""
_CLIENT_KEY = "orchestrate"
"""The caller's client_state is nested under this key so it cannot clash with DeepSpeed's own keys
(global_steps, skipped_steps, ...) in the same checkpoint dict."""


class DeepSpeedBackend:
    name = "deepspeed"
    zero_stages = (1, 2, 3)
    tie_break = 2
    priced_as = "deepspeed"
    # Chunked loss and activation offload verified on ZeRO-2/3, mlp_tiles too, sequence_parallel on ZeRO-3
    # (docs/measurements.md#backends); not
    # adamw8bit (DeepSpeed builds its own optimizer from the rendered config) nor embedding_offload (the
    # embedding is a parameter of its flat groups) (knobs.py). fused_kernels as under DDP.
    knobs = frozenset({"loss_chunks", "activation_offload", "fused_kernels", "mlp_tiles", "sequence_parallel"})

    def shards_parameters(self, sharding: Sharding) -> bool:
        return sharding.zero_stage == 3  # ZeRO-1/2 replicate parameters, partitioning states only

    def problems(self, sharding: Sharding) -> list[Problem]:
        return sharding_problems(sharding)

    def reads_weights(self, plan: RunPlan) -> bool:
        return True  # the engine's model is filled from the files (ZeRO-3: partitioned as it loads)

    def process_group(self, plan: RunPlan) -> str:
        return device_process_group(plan)

    def resume_conflicts(self, saved: dict[str, Any], strategy: Strategy) -> list[Problem]:
        # Partitions of another data-parallel size convert (universal checkpoint); another stage's do not.
        if saved["zero_stage"] == strategy.zero_stage:
            return []
        return [Problem("strategy.zero_stage", f"the checkpoint is ZeRO stage {saved['zero_stage']}, this plan uses "
                        f"stage {strategy.zero_stage}", f"set strategy.zero_stage: {saved['zero_stage']}, {EXPORT_FIX}")]

    def full_state_dict(self, ckpt_dir: Path, meta: CheckpointMeta) -> dict[str, torch.Tensor]:
        """zero_to_fp32's fp32 master weights (also for bf16/fp16 training); stage 0: the module's own."""
        import torch

        with weights_only_loads(deepspeed_checkpoint_classes()):
            if meta.strategy["zero_stage"] == 0:
                return torch.load(Path(ckpt_dir) / _CKPT_TAG / "mp_rank_00_model_states.pt",
                                  map_location="cpu")["module"]
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            with contextlib.redirect_stdout(io.StringIO()):  # a line per tensor group
                return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=_CKPT_TAG)

    def render(self, plan: RunPlan) -> dict[str, str]:
        return render(plan)

    def setup(self, plan: RunPlan, rank: Rank, model_dir: Path, objective: Objective,
              build_model: ModelBuilder) -> DeepSpeedTrainEngine:
        import deepspeed
        import torch

        from orchestrate.loading.tiled_mlp import tile_mlps

        # The rendered file minus its optimizer/scheduler blocks: the backend passes its own below.
        config = engine_config(plan)  # refuses a plan without a deepspeed strategy
        strategy = plan.strategy
        # gloo on CPU, nccl on GPU. If the worker already called init_process_group, DeepSpeed
        # wraps that group instead of creating a second one.
        deepspeed.init_distributed(dist_backend="nccl" if rank.device.type == "cuda" else "gloo", verbose=False)
        # ZeRO-3 may build the model inside zero.Init, loading it shard by shard into the partitions
        # (the base method decides: a LoRA base is adapted first, so its keys are not the checkpoint's and
        # it loads whole, deepspeed.initialize partitioning it); stages 0-2 replicate parameters, loaded
        # in the training dtype (the engine would cast them anyway, and builds the fp32 master from that copy).
        built = build_model(ModelRequest(
            "engine", rank.device, rank.rank, model_dir, getattr(torch, _LOAD_DTYPES[strategy.precision]),
            zero_init=config if strategy.zero_stage == 3 else None))
        model, hf_ds_config = built.model, built.keep_alive
        apply_fused_kernels(plan, model, rank.device.type)  # before checkpointing and deepspeed.initialize
        tile_mlps(model, strategy.mlp_tiles)  # after: the slices run the fused MLP's forward
        if strategy.activation_checkpointing and plan.shape.block_classes:  # your module's blocks, as under DDP/FSDP2
            from orchestrate.backends.hf_io import checkpoint_blocks

            checkpoint_blocks(model, list(plan.shape.block_classes))
        elif strategy.activation_checkpointing:
            # Non-reentrant checkpointing works with ZeRO-3's parameter hooks and needs no input grads.
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24; the old name warns
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

        opt = plan.config.train.optimizer
        trainable = [p for p in model.parameters() if p.requires_grad]  # a LoRA base is frozen
        hyper = {"lr": opt.lr, "betas": tuple(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay}
        if strategy.offload_optimizer != "none":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            # The optimizer step runs on the CPU next to the offloaded states (DeepSpeed requires its
            # CPU Adam there: zero_force_ds_cpu_optimizer).
            optimizer = DeepSpeedCPUAdam(trainable, adamw_mode=True, **hyper)
        else:
            optimizer = torch.optim.AdamW(trainable, **hyper)

        train = plan.config.train
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False,
            # A callable, so the schedule drives the optimizer DeepSpeed wraps (ZeRO replaces it).
            lr_scheduler=lambda wrapped: make_scheduler(wrapped, train))
        return DeepSpeedTrainEngine(engine, plan, rank, model_dir, objective, built.config, hf_ds_config)


class DeepSpeedTrainEngine:
    """orchestrate's TrainEngine over a `deepspeed.DeepSpeedEngine`."""

    def __init__(self, engine: Any, plan: RunPlan, rank: Rank, model_dir: Path, objective: Objective,
                 hf_config: Any, hf_ds_config: Any = None) -> None:
        strategy = plan.strategy
        self.engine = engine
        self.model = engine  # an nn.Module: forward returns the HF output with .loss
        self._rank, self.model_dir, self.hf_config = rank, model_dir, hf_config
        self._zero3 = strategy.zero_stage == 3
        self._activation_offload = strategy.activation_offload
        self._accumulation = plan.chosen.gradient_accumulation
        # Only ZeRO and the bf16/fp16 optimizers record the norm DeepSpeed computed for clipping
        # (engine._take_model_step reads optimizer._global_grad_norm); plain fp32 without ZeRO does not.
        self._own_grad_norm = strategy.zero_stage == 0 and strategy.precision == "fp32"
        self._hf_ds_config = hf_ds_config  # keeps transformers' ZeRO-3 weakref alive for this engine's life
        self._plan = plan
        self._frozen = has_frozen_parameters(engine.module)  # checkpoints hold what trains only
        # A Hugging Face model saves itself; your own module is saved as its state dict and description.
        self._hf = hasattr(engine.module, "save_pretrained")
        self.objective = objective
        self.phase = "forward"

    def _inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch on this rank's device, floating inputs in the dtype DeepSpeed cast the module to
        (an HF model embeds integer ids; your CNN takes float pixels, and DeepSpeed does not autocast)."""
        floating = any(v.is_floating_point() for v in batch.values())
        dtype = next(self.engine.module.parameters()).dtype if floating else None
        return {k: v.to(self._rank.device, dtype=dtype if v.is_floating_point() else None) for k, v in batch.items()}

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if not self._activation_offload:
            return self.objective.loss(self.engine, self._inputs(batch))
        import torch

        # As the torch engines' _forward_loss (backends/torch_engine.py): what the forward saves for
        # backward outside the recomputed blocks waits in host memory, pinned where there is a GPU.
        with torch.autograd.graph.save_on_cpu(pin_memory=self._rank.device.type == "cuda"):
            return self.objective.loss(self.engine, self._inputs(batch))

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        import torch

        # DeepSpeed counts micro steps itself and steps the optimizer on every accumulation-th one;
        # a different count would silently shift that boundary into the next train_step.
        if len(micro_batches) != self._accumulation:
            raise ValueError(f"expected {self._accumulation} micro-batches per step, got {len(micro_batches)}")
        engine = self.engine
        # Train mode on every step, as the other backends: from_pretrained (ZeRO-3's zero.Init build)
        # returns the model in eval mode, where transformers skips activation checkpointing and dropout.
        engine.train()
        lr = float(engine.get_lr()[0])  # what the scheduler set for this step
        skipped_before = engine.skipped_steps
        begin_step(self, micro_batches)
        losses = []
        grad_norm = math.nan
        for i, batch in enumerate(micro_batches):
            self.phase = "forward"
            loss = self._loss(batch)
            losses.append(loss.detach())  # unscaled; engine.backward divides by the accumulation itself
            self.phase = "backward"
            engine.backward(loss)
            if self._own_grad_norm and i == len(micro_batches) - 1:
                # After the boundary backward the grads are all-reduced; step() would zero them.
                grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
                grad_norm = float(torch.nn.utils.get_total_norm(grads))
            self.phase = "optimizer"  # a boundary step() runs the optimizer; the others only count
            engine.step()
        skipped = engine.skipped_steps != skipped_before
        if skipped:
            # DeepSpeed does not advance the schedule on an fp16 overflow; schedule.py counts
            # attempted steps (as the other backends' GradScaler loops do), so advance it here.
            engine.lr_scheduler.step()
        norm = engine.get_global_grad_norm()
        if norm is not None:
            grad_norm = float(norm)
        mean_loss = float(torch.stack(losses).float().mean())
        return StepResult(loss=mean_loss, grad_norm=grad_norm, lr=lr, skipped=skipped)

    def eval_sums(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Collective under ZeRO-3 (the forward gathers parameters): every rank must call it."""
        import torch

        was_training = self.engine.training
        self.engine.eval()
        try:
            with torch.no_grad():
                return self.objective.eval_sums(self.engine, self._inputs(batch))
        finally:
            self.engine.train(was_training)

    def model_state(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """The module's own weights: with fp32 training the fp32 master weights exactly; with bf16/fp16
        training the 16-bit copies the model trains with (what DeepSpeed's save_16bit_model and the HF
        Trainer export too), the fp32 masters staying in the checkpoint (zero_to_fp32.py recovers
        them). `trainable_only`: the fp32 masters of what trains (ZeRO gathers the partitions)."""
        import deepspeed.comm as dist
        from deepspeed.utils import safe_get_full_fp32_param

        from orchestrate.backends.hf_io import host_state_dict

        main = dist.get_rank() == 0
        if trainable_only:
            trained = {name: safe_get_full_fp32_param(p).cpu() for name, p in self.engine.module.named_parameters()
                       if p.requires_grad}
            return trained if main else {}
        if self._zero3:
            # Gathers one module at a time onto rank 0 (None elsewhere), as Accelerate's
            # get_state_dict does for ZeRO-3.
            return self.engine._zero3_consolidated_16bit_state_dict() or {}
        return host_state_dict(self.engine.module.state_dict()) if main else {}

    def save_hf_model(self, out_dir: Path) -> None:
        """Consolidated safetensors + config.json on rank 0 (`model_state`'s weights)."""
        import deepspeed.comm as dist

        from orchestrate.backends.hf_io import follow_umask, save_state_dir

        state = self.model_state()
        if dist.get_rank() == 0:
            if self._hf:
                self.engine.module.save_pretrained(Path(out_dir), state_dict=state)
            else:  # your own module: its state dict and its description
                save_state_dir(state, self.hf_config, Path(out_dir))
            follow_umask(Path(out_dir))
        dist.barrier()  # nobody reads the directory before it is complete

    def save_checkpoint(self, ckpt_dir: Path, client_state: dict[str, Any]) -> None:
        # Every rank writes its own optimizer partition; rank 0 also writes module, scheduler,
        # engine counters and zero_to_fp32.py. A frozen base is left out: it is re-read.
        self.engine.save_checkpoint(str(ckpt_dir), tag=_CKPT_TAG, client_state={_CLIENT_KEY: client_state},
                                    save_latest=False, exclude_frozen_parameters=self._frozen)

    def load_checkpoint(self, ckpt_dir: Path) -> dict[str, Any]:
        """Restore a checkpoint written on any data-parallel size: ZeRO partitions of another size
        are converted once (rank 0, DeepSpeed's ds_to_universal) into CKPT/universal and loaded with
        DeepSpeed's universal-checkpoint loader."""
        import deepspeed.comm as dist

        ckpt_dir = Path(ckpt_dir)
        if not (ckpt_dir / _CKPT_TAG).is_dir():
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {ckpt_dir / _CKPT_TAG}")
        saved_dp = len(list((ckpt_dir / _CKPT_TAG).glob(_OPTIM_FILES)))
        universal = self.engine.zero_optimization() and saved_dp != self.engine.dp_world_size
        load_dir = ckpt_dir
        if universal:
            load_dir = ckpt_dir / _UNIVERSAL_DIR
            if dist.get_rank() == 0 and not load_dir.is_dir():
                _convert_to_universal(ckpt_dir, load_dir)
            dist.barrier()
        config = self.engine._config  # read only inside load_checkpoint (engine.load_universal_checkpoint())
        config.load_universal_checkpoint = universal
        try:
            with weights_only_loads(deepspeed_checkpoint_classes()):
                path, client = self.engine.load_checkpoint(str(load_dir), tag=_CKPT_TAG, load_optimizer_states=True,
                                                           load_lr_scheduler_states=True,
                                                           load_module_strict=not self._frozen)
        finally:
            config.load_universal_checkpoint = False
        if path is None:
            raise FileNotFoundError(f"DeepSpeed could not load {load_dir / _CKPT_TAG}")
        if self.engine.lr_scheduler is not None:  # None: your own loop steps its own optimizer and schedule
            apply_hyperparameters(self.engine.lr_scheduler, self._plan.config.train)
        return client[_CLIENT_KEY]


def _convert_to_universal(ckpt_dir: Path, out_dir: Path) -> None:
    """ds_to_universal into a temporary directory renamed into place: an interrupted conversion
    is redone, never half used. In-process, one worker: the other ranks wait at a barrier."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    args = argparse.Namespace(input_folder=str(ckpt_dir / _CKPT_TAG), output_folder=str(tmp / _CKPT_TAG),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              # our engines do not record UNIVERSAL_CHECKPOINT_INFO (no tensor/pipeline
                              # parallelism to describe); the default version entry is all it needs
                              inject_missing_state=True)
    # stdout, stderr: a page of progress lines and bars per conversion
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            weights_only_loads(deepspeed_checkpoint_classes()):
        ds_to_universal(args)
    tmp.rename(out_dir)
    print(f"orchestrate: converted {ckpt_dir.name} to a DeepSpeed universal checkpoint for a new world size",
          flush=True)


BACKEND = DeepSpeedBackend()
