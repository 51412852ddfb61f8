"""Learning-rate schedule shared by every backend: linear warm-up, then cosine decay.

One function for all backends so that DeepSpeed, FSDP2 and DDP runs from the same weights and
data take identical steps (the cosine-with-warm-up shape of Loshchilov & Hutter 2017, SGDR, as
used by GPT-3 / Llama training recipes).
"""

from __future__ import annotations

import math
import warnings

from orchestrate.config.schema import TrainSection


def lr_multiplier(step: int, train: TrainSection) -> float:
    """Factor applied to `train.optimizer.lr` for optimizer step `step` (0-based)."""
    warmup = train.schedule.warmup_steps
    if warmup and step < warmup:
        return (step + 1) / warmup  # never 0: a zero first step would waste the first batch
    decay_steps = max(1, train.max_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    floor = train.schedule.min_lr_ratio
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer, train: TrainSection):
    """A torch LambdaLR over `lr_multiplier`; call `.step()` once per optimizer step."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, lambda step: lr_multiplier(step, train))


def step_schedule(scheduler, skipped: bool) -> None:
    """Advance the schedule once per attempted step, skipped fp16 steps too (as the DeepSpeed backend
    does), without torch's "lr_scheduler.step() before optimizer.step()" warning for those."""
    with warnings.catch_warnings():
        if skipped:
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        scheduler.step()
