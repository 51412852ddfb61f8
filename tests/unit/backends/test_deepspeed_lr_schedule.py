"""deepspeed.json's optimizer/scheduler blocks run through DeepSpeed's own WarmupCosineLR, compared with
the schedule every orchestrate backend uses (`orchestrate/backends/schedule.py`)."""

from __future__ import annotations

import pytest
import torch

from orchestrate.backends.deepspeed_render import engine_config, render_config
from orchestrate.backends.schedule import lr_multiplier
from orchestrate.planner.strategy import Strategy
from tests.helpers.plans import make_plan

ZERO2 = Strategy("deepspeed", 2, "none", "none", "fp32", False, 2)


def _plan():
    return make_plan(ZERO2, config={"train": {"max_steps": 20, "schedule": {"warmup_steps": 5, "min_lr_ratio": 0.1},
                                              "optimizer": {"lr": 2e-3}}})


def _deepspeed_applied_lrs(cfg: dict, steps: int) -> list[float]:
    """The lr each optimizer step runs at under DeepSpeed's scheduler built from the block (the
    engine steps the scheduler after every optimizer step, engine.py `_take_model_step`)."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg["optimizer"]["params"]["lr"])
    sched = WarmupCosineLR(opt, **cfg["scheduler"]["params"])
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        sched.step()
    return out


def test_cosine_part_lags_one_step_and_warmup_two():
    plan = _plan()
    train = plan.config.train
    ds = _deepspeed_applied_lrs(render_config(plan), train.max_steps)
    ours = [2e-3 * lr_multiplier(k, train) for k in range(train.max_steps)]
    warm = train.schedule.warmup_steps
    # From step W+1 on the same cosine one step later: DeepSpeed's step k runs at orchestrate's k-1.
    assert ds[warm + 1:] == pytest.approx(ours[warm:-1], abs=1e-12)
    # Warm-up: DeepSpeed runs step k at (k-1)/W (0 for k = 0), orchestrate at (k+1)/W.
    assert ds[:warm + 1] == pytest.approx([0.0] + [2e-3 * (k - 1) / warm for k in range(1, warm + 1)], abs=1e-15)
    assert ours[:warm] == pytest.approx([2e-3 * (k + 1) / warm for k in range(warm)], abs=1e-15)


def test_engine_config_is_the_file_without_the_blocks():
    plan = _plan()
    full, engine = render_config(plan), engine_config(plan)
    assert {"optimizer", "scheduler"} <= set(full) and not {"optimizer", "scheduler"} & set(engine)
    assert {k: v for k, v in full.items() if k not in ("optimizer", "scheduler")} == engine
    assert full["optimizer"] == {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                              "weight_decay": 0.1}}
