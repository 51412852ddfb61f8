"""`train.num_epochs` and `train.neftune_noise_alpha` through a whole launch (1 CPU rank, tiny GPT-2 on
the demo corpus): the prepare line and the worker resolve the epochs into the steps transformers'
Trainer would count for those samples, the run trains that many steps with noised embeddings and
learns, a run rolled back to a mid-run checkpoint resumes to the very same losses and weights (the
step count, the schedule and the noise all continue), and the noise is really in the forward (the
first step's loss differs without it)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.cli import invoke
from tests.helpers.plans import TINY_GPT2

EPOCHS = 0.01


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"architecture": dict(TINY_GPT2)},
        "train": {"seq_len": 32, "global_batch_size": 8, "micro_batch_size": 4, "num_epochs": EPOCHS,
                  "neftune_noise_alpha": 5.0, "checkpoint_every": 4, "keep_checkpoints": 5, "seed": 0,
                  "optimizer": {"lr": 3e-3}, "schedule": {"warmup_steps": 2}, "output_dir": "runs"},
        "data": {"generate_demo_corpus": True}}))
    return path


def _launch(config: Path, run_dir: Path, *extra: str) -> str:
    result = invoke("launch", config, "--gpus", "1", "--run-dir", run_dir, *extra)
    assert result.exit_code == 0, result.output
    return result.output


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model" / "model.safetensors"))


@pytest.mark.slow
def test_epochs_resolve_train_with_noise_and_resume_bit_exact(tmp_path):
    config = _config(tmp_path)
    out = _launch(config, tmp_path / "run")
    samples = int(re.search(r"-> ([\d,]+) train / [\d,]+ validation blocks", out).group(1).replace(",", ""))
    steps = math.ceil(EPOCHS * math.ceil(samples / 8))  # transformers' count (tests/unit/config/test_training_length.py)
    assert f"{EPOCHS:g} epochs = {steps} steps ({samples:,} training samples per epoch, global batch 8)" in out
    assert f"training ddp-fp32-mb4 on 1 rank(s): {EPOCHS:g} epochs = {steps} steps" in out
    losses = _losses(tmp_path / "run")
    assert len(losses) == steps >= 12 and losses[0] > 5.0 and max(losses[-3:]) < losses[0] - 1.0  # it learns
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())["config"]["train"]
    assert plan["num_epochs"] == EPOCHS and "max_steps" not in plan  # plan.json keeps the length as given

    rolled = tmp_path / "rolled"
    shutil.copytree(tmp_path / "run", rolled)
    for ckpt in (rolled / "checkpoints").glob("step-*"):
        if int(ckpt.name.split("-")[1]) > 8:
            shutil.rmtree(ckpt)
    (rolled / "checkpoints" / "latest").write_text("step-00000008\n")
    shutil.rmtree(rolled / "model")
    _launch(config, rolled, "--resume")
    assert _losses(rolled) == losses
    got, want = _weights(rolled), _weights(tmp_path / "run")
    assert [k for k in want if not torch.equal(got[k], want[k])] == []

    _launch(config, tmp_path / "clean", "--set", "train.neftune_noise_alpha=null", "--set", "train.num_epochs=null",
            "--set", "train.max_steps=1")
    assert _losses(tmp_path / "clean")[0] != losses[0]  # the same first batch without the noise
