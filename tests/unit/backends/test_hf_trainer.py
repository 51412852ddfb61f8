"""`orchestrate config --for hf-trainer`: a DeepSpeed config a stock HF Trainer takes as it is ("auto"
wherever the Trainer fills a value) and TrainingArguments values with which it trains at the plan's
learning rates, step for step (tests/helpers/hf_trainer_script.py is the stock script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrate import api
from orchestrate.backends.hf_trainer_render import (
    DEEPSPEED_FILE,
    TRAINING_ARGS_FILE,
    hf_deepspeed_config,
    training_args,
)
from orchestrate.backends.schedule import lr_multiplier
from orchestrate.errors import UserError
from orchestrate.planner.strategy import Strategy
from orchestrate.ports import free_port
from tests.helpers.plans import make_plan

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "tests" / "helpers" / "hf_trainer_script.py"
TRAIN = {"max_steps": 8, "schedule": {"warmup_steps": 3, "min_lr_ratio": 0.1}, "optimizer": {"lr": 2e-3}}


ZERO2_BF16 = Strategy("deepspeed", 2, "none", "none", "bf16", False, 2)


def _plan(strategy: Strategy = ZERO2_BF16):
    return make_plan(strategy, config={"train": TRAIN})


def _hf_args(plan, world_size: int) -> SimpleNamespace:
    """What HfTrainerDeepSpeedConfig reads from TrainingArguments, from the plan's training args."""
    a = training_args(plan)
    return SimpleNamespace(world_size=world_size, per_device_train_batch_size=a["per_device_train_batch_size"],
                           gradient_accumulation_steps=a["gradient_accumulation_steps"], max_grad_norm=a["max_grad_norm"],
                           learning_rate=a["learning_rate"], adam_beta1=a["adam_beta1"], adam_beta2=a["adam_beta2"],
                           adam_epsilon=a["adam_epsilon"], weight_decay=a["weight_decay"], save_on_each_node=False,
                           fp16=a["fp16"], fp16_full_eval=False, bf16=a["bf16"], bf16_full_eval=False,
                           get_warmup_steps=lambda _total: a["warmup_steps"])


def test_auto_exactly_where_the_trainer_fills_and_no_scheduler():
    plan = _plan()
    cfg = hf_deepspeed_config(plan)
    assert "scheduler" not in cfg
    autos = {k for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                         "gradient_clipping") if cfg[k] == "auto"}
    assert len(autos) == 4 and cfg["bf16"]["enabled"] == cfg["fp16"]["enabled"] == "auto"
    assert cfg["optimizer"] == {"type": "AdamW", "params": dict.fromkeys(("lr", "betas", "eps", "weight_decay"), "auto")}
    # What HF does not fill stays the plan's.
    from orchestrate.backends.deepspeed_render import render_config

    assert cfg["zero_optimization"] == render_config(plan)["zero_optimization"]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_transformers_fills_it_without_mismatch_for_any_world_size(world_size):
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    plan = _plan()
    ds = HfTrainerDeepSpeedConfig(hf_deepspeed_config(plan))
    args = _hf_args(plan, world_size)
    ds.trainer_config_process(args)
    ds.trainer_config_finalize(args, model=None, num_training_steps=plan.config.train.max_steps)  # raises on mismatch
    cfg, opt = ds.config, plan.config.train.optimizer
    micro, accumulation = plan.strategy.micro_batch_size, plan.chosen.gradient_accumulation
    assert cfg["train_batch_size"] == micro * accumulation * world_size
    assert cfg["optimizer"]["params"] == {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps,
                                          "weight_decay": opt.weight_decay}
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    assert cfg["gradient_clipping"] == plan.config.train.grad_clip


def test_epochs_and_neftune_go_to_the_trainer_as_its_own_arguments():
    # The Trainer counts epochs as steps over its dataloader as orchestrate does (TrainSection.epoch_steps);
    # deepspeed.json has no scheduler block then (WarmupCosineLR needs the total, known at prepare only).
    from orchestrate.backends.deepspeed_render import render_config

    plan = make_plan(ZERO2_BF16, config={"train": {**TRAIN, "max_steps": None, "num_epochs": 1.5,
                                                   "neftune_noise_alpha": 5.0}})
    args = training_args(plan)
    assert (args["num_train_epochs"], args["neftune_noise_alpha"]) == (1.5, 5.0) and "max_steps" not in args
    assert "scheduler" not in render_config(plan)
    steps = training_args(_plan())
    assert steps["max_steps"] == 8 and "num_train_epochs" not in steps and "neftune_noise_alpha" not in steps
    assert render_config(_plan())["scheduler"]["params"]["total_num_steps"] == 8


def test_a_plan_without_deepspeed_is_refused():
    with pytest.raises(UserError, match="strategy.backend=deepspeed"):
        hf_deepspeed_config(_plan(Strategy("fsdp", 3, "none", "none", "fp32", False, 2)))


def test_write_config_refuses_before_writing_anything(tmp_path):
    config = api.load_config(REPO / "examples" / "tiny-gpt2.yaml", ["strategy.backend=fsdp"])
    with pytest.raises(UserError, match="DeepSpeed plan"):
        api.write_config(config, api.HardwareFlags(gpus=2), tmp_path / "out", for_tool="hf-trainer")
    assert not (tmp_path / "out").exists()


def _train_with_stock_trainer(out: Path, nproc: int) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script needs no orchestrate
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", str(SCRIPT), str(out / DEEPSPEED_FILE), str(out / TRAINING_ARGS_FILE),
           str(out / f"trainer-{nproc}")]
    done = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / f"trainer-{nproc}" / "lrs.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_stock_trainer_runs_the_plans_learning_rates(tmp_path, nproc):
    overrides = ["strategy.backend=deepspeed", "train.max_steps=8", "train.schedule.warmup_steps=3",
                 "train.schedule.min_lr_ratio=0.1", "train.optimizer.lr=2e-3"]
    plan = api.write_config(api.load_config(REPO / "examples" / "tiny-gpt2.yaml", overrides), api.HardwareFlags(gpus=2),
                            tmp_path, for_tool="hf-trainer")
    lrs = _train_with_stock_trainer(tmp_path, nproc)
    train = plan.config.train
    expected = [train.optimizer.lr * lr_multiplier(k, train) for k in range(train.max_steps)]
    assert len(lrs) == train.max_steps
    assert lrs == pytest.approx(expected, abs=1e-9, rel=0)
