"""Your own nn.Module trains on 2 gloo ranks: the example CNN (examples/cnn/cnn.yaml, the same
YAML that runs on GPUs) trains from its own nn.Module and dataset factory to >= 0.9 validation
accuracy under DDP, FSDP2 and DeepSpeed ZeRO-2, and the saved state dict loads into the module."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from orchestrate.config.load import load_config
from orchestrate.launch.rundir import prepare_run
from orchestrate.launch.session import start
from orchestrate.model.meta import shape_for
from orchestrate.planner.plan import RunPlan
from orchestrate.planning import weigh
from orchestrate.transports.local.transport import LocalTorchrun
from tests.helpers.plans import cpu_hardware

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "cnn"
# Fewer samples and steps than the example, to stay well under a minute per run on 2 busy cores.
SMALL = ["data.kwargs.size=800", "train.max_steps=30", "train.eval_batches=3"]


@pytest.mark.slow
@pytest.mark.parametrize("pins", [["strategy.backend=ddp"], ["strategy.backend=fsdp", "strategy.zero_stage=3"],
                                  ["strategy.backend=deepspeed", "strategy.zero_stage=2"]],
                         ids=["ddp", "fsdp2", "zero2"])
def test_the_example_cnn_trains_to_ninety_percent_and_its_weights_load(tmp_path: Path, monkeypatch, pins):
    import torch
    from safetensors.torch import load_file

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = load_config(EXAMPLE / "cnn.yaml", [*SMALL, *pins, f"train.output_dir={tmp_path}"])
    plan = weigh(config, cpu_hardware(2), shape_for(config))
    assert isinstance(plan, RunPlan) and plan.strategy.backend == pins[0].split("=")[1]
    run_dir = tmp_path / "run"
    assert start(prepare_run(plan, run_dir), run_dir.resolve(), LocalTorchrun()).exit_code == 0

    final = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    print(plan.chosen.name, {k: v for k, v in final.items() if k.startswith("eval")})
    assert final["step"] == 30 and final["eval_accuracy"] >= 0.9, final

    saved = json.loads((run_dir / "model" / "config.json").read_text())
    assert saved == {"orchestrate_module": "cnn_example:CNN", "kwargs": {"channels": 32, "num_classes": 10}}
    sys.path.insert(0, str(EXAMPLE))
    try:
        from cnn_example import CNN, patterns
    finally:
        sys.path.remove(str(EXAMPLE))
    model = CNN(**saved["kwargs"])
    model.load_state_dict(load_file(run_dir / "model" / "model.safetensors"))  # strict: every tensor is there
    images, labels = zip(*(patterns(size=800)[i] for i in range(200)), strict=True)
    accuracy = (model(torch.stack(images)).argmax(-1) == torch.stack(labels)).float().mean().item()
    assert accuracy >= 0.9, accuracy


@pytest.mark.slow
def test_dict_samples_with_the_models_own_loss_train_under_fsdp2_with_detected_blocks(tmp_path: Path, monkeypatch):
    from orchestrate.config.load import config_from_dict

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = config_from_dict({
        "model": {"module": "tests.helpers.custom_modules:WithOwnLoss", "kwargs": {"width": 32, "depth": 2},
                  "trust_remote_code": True},
        "data": {"module": "tests.helpers.custom_modules:rule", "kwargs": {"size": 256}, "validation_ratio": 0.25},
        "train": {"seq_len": 1, "global_batch_size": 32, "max_steps": 20, "loss": "model", "eval_batches": 2,
                  "optimizer": {"lr": 3e-3, "weight_decay": 0.0}, "schedule": {"warmup_steps": 0},
                  "report_to": ["none"], "output_dir": str(tmp_path)},
        "strategy": {"backend": "fsdp", "zero_stage": 3}}, tmp_path)
    plan = weigh(config, cpu_hardware(2), shape_for(config))
    assert plan.shape.block_classes == ("Block",)
    run_dir = tmp_path / "run"
    assert start(prepare_run(plan, run_dir), run_dir.resolve(), LocalTorchrun()).exit_code == 0
    fsdp = json.loads((run_dir / "fsdp.json").read_text())
    assert fsdp["fully_shard"]["block_classes"] == ["Block"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print("own-loss fsdp2:", records[0]["loss"], "->", records[-1]["loss"], records[-1].get("eval_accuracy"))
    assert records[-1]["loss"] < 0.7 * records[0]["loss"] and "eval_accuracy" in records[-1]


def _launch(run_dir: Path, *flags: str, env: dict) -> None:
    import subprocess

    cmd = [sys.executable, "-m", "orchestrate", "launch", "--gpus", "2", "--run-dir", str(run_dir), *flags,
           "--set", "strategy.backend=ddp", "--set", "data.kwargs.size=400", "--set", "train.checkpoint_every=3",
           str(EXAMPLE / "cnn.yaml")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_a_resumed_custom_module_run_continues_exactly(tmp_path: Path):
    import os

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH", "")])}
    _launch(tmp_path / "resumed", "--set", "train.max_steps=6", env=env)
    _launch(tmp_path / "resumed", "--resume", "--set", "train.max_steps=9", env=env)
    _launch(tmp_path / "straight", "--set", "train.max_steps=9", env=env)

    def losses(name: str) -> dict[int, float]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines)}

    resumed, straight = losses("resumed"), losses("straight")
    assert sorted(resumed) == list(range(1, 10))
    assert [resumed[s] for s in (7, 8, 9)] == [straight[s] for s in (7, 8, 9)]  # same samples, same weights
