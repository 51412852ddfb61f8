"""What `orchestrate.prepare` returns as the optimizer: the seed's `optimizer.zero_grad()` and
`optimizer.step()` keep their places in the loop and do what the plan says.

- `PlannedOptimizer` (DDP, FSDP2): `step()` on every micro-batch, the real step on every
  `gradient_accumulation`-th (unscale for fp16, clip to `train.grad_clip`, step, scaler update);
  `zero_grad()` only right after a real step, so gradients accumulate in between. `backward`
  divides the loss by the accumulation, so the step sees the mean, as the worker's loop does
  (orchestrate.backends.torch_engine).
- `DeepSpeedOptimizer`: DeepSpeed counts micro-batches, clips and zeroes the gradients itself
  (engine.step at the boundary), so `step()` is `engine.step()` and `zero_grad()` does nothing.

Anything else (param_groups, state, a scheduler made on the original optimizer) is the original's.
"""

from __future__ import annotations

from typing import Any


class PlannedOptimizer:
    def __init__(self, optimizer: Any, model: Any, accumulation: int, grad_clip: float | None, scaler: Any) -> None:
        self.optimizer = optimizer
        self.model = model
        self.accumulation = accumulation
        self.grad_clip = grad_clip
        self.scaler = scaler
        self.micro_steps = 0
        self.steps = 0
        """Optimizer steps taken (what a checkpoint is named by)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.micro_steps % self.accumulation == 0:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def backward(self, loss: Any) -> None:
        scaled = loss / self.accumulation  # mean over micro-batches; the collectives average over ranks
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()

    def step(self) -> None:
        import torch

        self.micro_steps += 1
        if self.micro_steps % self.accumulation:
            return
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.steps += 1

    def restore(self, steps: int) -> None:
        self.steps, self.micro_steps = steps, steps * self.accumulation


class DeepSpeedOptimizer:
    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine.optimizer, name)

    @property
    def steps(self) -> int:
        return int(self.engine.global_steps)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """DeepSpeed zeroes the gradients after its own boundary step."""

    def backward(self, loss: Any) -> None:
        self.engine.backward(loss)  # divides by the accumulation itself

    def step(self) -> None:
        self.engine.step()

    def restore(self, steps: int) -> None:
        """The engine's load_checkpoint restored its step counters."""
