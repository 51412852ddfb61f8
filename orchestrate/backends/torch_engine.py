"""What the DDP and FSDP backends share: the settings both render and the train-step skeleton.

Both drive a plain torch optimizer, scheduler and optional GradScaler over a wrapped HF model; they
differ only in how a micro-batch runs (autocast, gradient sync) and in how state is saved, which the
subclasses supply.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.backends.base import StepResult, begin_step, has_frozen_parameters
from orchestrate.backends.schedule import step_schedule

if TYPE_CHECKING:
    import torch

    from orchestrate.backends.base import Objective
    from orchestrate.backends.rank import Rank
    from orchestrate.config.train import TrainSection
    from orchestrate.planner.plan import Candidate, RunPlan

CLIENT_STATE_FILE = "client_state.json"
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def chosen_for(plan: RunPlan, backend: str) -> Candidate:
    """The plan's chosen candidate; ValueError unless its strategy uses `backend`."""
    cand = plan.chosen
    if cand is None or cand.strategy.backend != backend:
        raise ValueError(f"{backend}_settings needs a plan whose chosen strategy uses the {backend} backend")
    return cand


def run_settings(plan: RunPlan) -> dict[str, Any]:
    """The leading entries of ddp.json and fsdp.json: which backend, strategy, device and world size."""
    s = plan.strategy
    return {"backend": s.backend, "strategy": s.name, "device_type": "cuda" if plan.hardware.has_gpu else "cpu",
            "world_size": plan.world_size}


def adamw_settings(train: TrainSection, fused: bool, name: str = "adamw") -> dict[str, Any]:
    """`name`: the plan's optimizer (Strategy.optimizer): adamw, or adamw8bit (DDP only, planner/knobs.py)."""
    opt = train.optimizer
    return {"name": name, "lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps,
            "weight_decay": opt.weight_decay, "fused": fused}


def mlp_tiles_step(tiles: int, how: str) -> str:
    """The settings' `steps` line of a plan with `Strategy.mlp_tiles` on (loading/tiled_mlp.py); `how`:
    what recomputes the slices."""
    return (f"run each block's MLP over {tiles} slices of the sequence, each recomputed in backward ({how}): "
            "one slice's intermediate-sized activations at a time")


def make_optimizer(params: list, opt: dict[str, Any], on_gpu: bool) -> torch.optim.Optimizer:
    """torch AdamW (fused on GPU), or bitsandbytes AdamW8bit: block-wise 8-bit m and v; bitsandbytes
    keeps 32-bit state for tensors under 4096 values (`min_8bit_size`), a rounding error in the plan."""
    import torch

    hyper = {"lr": opt["lr"], "betas": tuple(opt["betas"]), "eps": opt["eps"], "weight_decay": opt["weight_decay"]}
    if opt["name"] == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **hyper)
    return torch.optim.AdamW(params, **hyper, fused=opt["fused"] and on_gpu)


def schedule_settings(train: TrainSection) -> dict[str, Any]:
    return {"warmup_steps": train.schedule.warmup_steps, "min_lr_ratio": train.schedule.min_lr_ratio,
            "max_steps": train.max_steps, "shape": "linear warm-up, cosine decay"}


def check_world_size(settings: dict[str, Any], rank: Rank) -> None:
    if rank.world_size != settings["world_size"]:
        raise RuntimeError(f"plan is for {settings['world_size']} ranks, this job has {rank.world_size}")


def write_client_state(ckpt_dir: Path, client_state: dict[str, Any]) -> None:
    (Path(ckpt_dir) / CLIENT_STATE_FILE).write_text(json.dumps(client_state, indent=1))


def read_client_state(ckpt_dir: Path) -> dict[str, Any]:
    return json.loads((Path(ckpt_dir) / CLIENT_STATE_FILE).read_text())


class TorchEngine:
    """TrainEngine over a torch-wrapped model; subclasses add checkpointing and the per-backend hooks."""

    def __init__(self, model, optimizer, scheduler, scaler, settings: dict, hf_config, layout, rank: Rank,
                 model_dir: Path, objective: Objective):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.settings = settings
        self.hf_config = hf_config
        self.layout = layout
        self.rank = rank
        self.model_dir = model_dir
        self.frozen = has_frozen_parameters(model)
        """Part of the model is frozen: checkpoints hold what trains only."""
        self.objective = objective
        self.phase = "forward"

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.rank.device, non_blocking=True) for k, v in batch.items()}

    def _forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.settings.get("activation_offload"):
            import torch

            # Every tensor saved for backward outside the recomputed blocks (the checkpointed blocks'
            # inputs) waits in pinned host memory until backward brings it back (planner/knobs.py).
            # (Pinned only where there is a device to copy back to: pinning needs CUDA.)
            with torch.autograd.graph.save_on_cpu(pin_memory=self.rank.device.type == "cuda"):
                return self.objective.loss(self.model, self._to_device(batch))
        return self.objective.loss(self.model, self._to_device(batch))

    def _gradient_sync(self, index: int, count: int) -> contextlib.AbstractContextManager:
        """Context for micro-batch `index` of `count`: by default every backward syncs gradients."""
        return contextlib.nullcontext()

    def _global_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return norm

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        import torch

        self.model.train()
        begin_step(self, micro_batches)
        n = len(micro_batches)
        losses = []
        for i, batch in enumerate(micro_batches):
            with self._gradient_sync(i, n):
                self.phase = "forward"
                loss = self._forward_loss(batch)
                losses.append(loss.detach().float())
                scaled = loss / n  # mean over micro-batches; the gradient collective averages over ranks
                self.phase = "backward"
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        self.phase = "optimizer"
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.settings["grad_clip"] or math.inf  # inf: measure the norm, clip nothing
        norm = self._global_norm(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = False
        if self.scaler:
            scale = self.scaler.get_scale()
            # The inf/nan check agrees across ranks (replicated grads, or ShardedGradScaler's all-reduce),
            # so every rank skips the same steps; the scale backs off exactly when a step was skipped.
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        step_schedule(self.scheduler, skipped)
        return StepResult(loss=torch.stack(losses).mean().item(), grad_norm=float(norm), lr=lr, skipped=skipped)

    def eval_sums(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        import torch

        self.model.eval()
        with torch.no_grad():
            sums = self.objective.eval_sums(self.model, self._to_device(batch))
        self.model.train()
        return sums
