"""orchestrate's learning-rate schedule is transformers' "cosine_warmup_with_min_lr" (so a stock HF
Trainer reproduces it) and keeps the promise of `train.schedule.min_lr_ratio`: the floor on the last step."""

from __future__ import annotations

import pytest
from transformers.optimization import _get_cosine_with_min_lr_schedule_with_warmup_lr_rate_lambda as hf_lambda

from orchestrate.backends.schedule import lr_multiplier
from orchestrate.config.train import TrainSection


def _train(max_steps: int, warmup: int, floor: float) -> TrainSection:
    return TrainSection(seq_len=8, global_batch_size=2, max_steps=max_steps, schedule={"warmup_steps": warmup, "min_lr_ratio": floor})


@pytest.mark.parametrize(("max_steps", "warmup", "floor"), [(20, 5, 0.1), (12, 0, 0.0), (7, 1, 0.5), (30, 10, 0.1),
                                                             (4, 4, 0.2)])
def test_equals_transformers_cosine_warmup_with_min_lr(max_steps, warmup, floor):
    train = _train(max_steps, warmup, floor)
    ours = [lr_multiplier(k, train) for k in range(max_steps)]
    theirs = [hf_lambda(k, num_warmup_steps=warmup, num_training_steps=max_steps, num_cycles=0.5, min_lr_rate=floor)
              for k in range(max_steps)]
    assert ours == pytest.approx(theirs, abs=1e-12)


def test_warmup_never_zero_peak_once_floor_on_the_last_step():
    train = _train(20, 5, 0.1)
    ours = [lr_multiplier(k, train) for k in range(20)]
    assert ours[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0], abs=1e-15)
    assert ours.count(1.0) == 1 and ours[5] < 1.0
    assert ours[-1] == pytest.approx(0.1, abs=1e-15)
    assert lr_multiplier(25, train) == pytest.approx(0.1, abs=1e-15)  # clamped past the end
