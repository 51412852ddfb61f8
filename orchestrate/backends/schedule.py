"""Learning-rate schedule shared by every backend: linear warm-up, then cosine decay.

One function for all backends so that DeepSpeed, FSDP2 and DDP runs from the same weights and
data take identical steps (the cosine-with-warm-up shape of Loshchilov & Hutter 2017, SGDR, as
used by GPT-3 / Llama training recipes).

It is exactly transformers' "cosine_warmup_with_min_lr" schedule
(`transformers.optimization.get_cosine_with_min_lr_schedule_with_warmup_lr_rate`, warmup_lr_rate
unset, num_cycles 0.5), so a stock HF Trainer given `orchestrate config --for hf-trainer`'s
arguments steps at the very same learning rates.
Step k (0-based) runs at (k+1)/W in warm-up, then the cosine of (k - W + 1) / (T - W): the peak
once (step W-1) and `min_lr_ratio` on the last step T-1, as `train.schedule.min_lr_ratio` promises.
"""

from __future__ import annotations

import math
import warnings

from orchestrate.config.train import TrainSection


def lr_multiplier(step: int, train: TrainSection) -> float:
    """Factor applied to `train.optimizer.lr` for optimizer step `step` (0-based)."""
    warmup = train.schedule.warmup_steps
    if warmup and step < warmup:
        return (step + 1) / warmup  # never 0: a zero first step would waste the first batch
    decay_steps = max(1, train.max_steps - warmup)
    # +1: the step after the peak already decays, and the last step (T-1) reaches the floor.
    progress = min(1.0, (step - warmup + 1) / decay_steps)
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


def apply_hyperparameters(scheduler, train: TrainSection) -> None:
    """After a checkpoint's optimizer and schedule state are loaded, the plan's optimizer settings and
    schedule from the next step on. Loading brings back the values they were saved with (torch's
    `Optimizer.load_state_dict` replaces every param group's settings, `LambdaLR`'s its base_lrs), so
    a `--resume` with a changed learning rate would train on with the old one. The moments and the
    step count are kept; with unchanged settings every value is the one loaded."""
    opt = train.optimizer
    groups = scheduler.optimizer.param_groups  # DeepSpeed: the ZeRO optimizer's, the schedule's own
    scheduler.base_lrs = [opt.lr] * len(groups)
    for group in groups:
        group.update(betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay, initial_lr=opt.lr,
                     lr=opt.lr * lr_multiplier(scheduler.last_epoch, train))
    scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reports
