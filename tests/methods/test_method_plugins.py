"""A training method from another package, found through the `orchestrate.methods` entry points:
a tiny package and its `*.dist-info` written into tmp_path and put on PYTHONPATH, as an installed
plug-in would be. The registry reads the entry points when it is imported, so every check runs in a
fresh interpreter (the launcher's, and in the slow test the workers' too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny-gpt2.yaml"

STEPMARK = '''
"""On full fine-tuning, every metrics record says how many steps this run has seen."""
from orchestrate.methods.full.method import FULL
from orchestrate.methods.spec import Method


class StepMark(Method):
    name = "stepmark"
    bases = ("full",)
    runtime = "stepmark.runtime"
    metric_keys = ("marked_steps",)

    def active(self, config):
        return FULL.active(config)

    def report(self, plan):
        return ["stepmark: every step marked"], {"stepmark": True}


METHOD = StepMark()
'''

STEPMARK_RUNTIME = '''
from orchestrate.methods.runtime import MethodRuntime
from orchestrate.worker.callbacks.base import Callback, Phase


class MarkSteps(Callback):
    phase = Phase.MEASURE

    def on_train_start(self, training):
        self.seen = 0

    def on_step_end(self, training, end):
        self.seen += 1
        end.add({"marked_steps": self.seen})


class StepMarkRuntime(MethodRuntime):
    def callbacks(self, plan):
        return [MarkSteps()]


RUNTIME = StepMarkRuntime()
'''


def _install(root: Path, package: str, files: dict[str, str], entry_points: dict[str, str]) -> None:
    """`package` as pip would leave it in site-packages: its modules and a dist-info naming its
    `orchestrate.methods` entry points."""
    (root / package).mkdir(parents=True)
    for name, text in files.items():
        (root / package / name).write_text(text)
    info = root / f"{package}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[orchestrate.methods]\n{lines}")


def _env(root: Path, tmp_path: Path) -> dict[str, str]:
    paths = [str(root), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
            "XDG_CACHE_HOME": str(tmp_path / "cache")}


FOUND = """
import json, sys
from click.testing import CliRunner
from orchestrate.cli import cli
from orchestrate.config.load import load_config
from orchestrate.methods.registry import active_methods, methods

plan = CliRunner().invoke(cli, ["plan", sys.argv[1], "--gpus", "2", "--json"])
print(json.dumps({"methods": [m.name for m in methods()], "active": [m.name for m in active_methods(load_config(sys.argv[1]))],
                  "exit": plan.exit_code, "plan": plan.output}))
"""
"""What the registry finds, which methods the tiny config asks for, and `orchestrate plan --json` of it."""


@pytest.fixture
def stepmark(tmp_path: Path) -> dict[str, str]:
    root = tmp_path / "site"
    _install(root, "stepmark", {"__init__.py": STEPMARK, "runtime.py": STEPMARK_RUNTIME},
             {"stepmark": "stepmark:METHOD"})
    return _env(root, tmp_path)


def test_a_plug_in_method_is_found_runs_in_hook_order_and_plans(stepmark):
    done = subprocess.run([sys.executable, "-c", FOUND, str(TINY)], cwd=REPO, env=stepmark, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["methods"] == ["full", "lora", "distill", "preference", "grpo", "prune", "stepmark", "custom"]
    assert found["active"] == ["full", "stepmark"]
    assert found["exit"] == 0 and json.loads(found["plan"])["stepmark"] is True


def test_a_name_taken_twice_or_no_method_is_one_message(tmp_path: Path):
    root = tmp_path / "site"
    _install(root, "clash", {"__init__.py": "from orchestrate.methods.full.method import FULL as METHOD\n"
                                            "NOT_A_METHOD = 3\n"},
             {"full": "clash:METHOD", "three": "clash:NOT_A_METHOD"})
    done = subprocess.run([sys.executable, "-m", "orchestrate", "plan", str(TINY), "--gpus", "2"], cwd=REPO,
                          env=_env(root, tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "orchestrate.methods entry point full = clash:METHOD: names its method 'full', as orchestrate's own" \
           in done.stderr
    assert "orchestrate.methods entry point three = clash:NOT_A_METHOD: names a value of type int, not a Method" in done.stderr


@pytest.mark.slow
def test_a_plug_in_method_trains_on_two_gloo_ranks(stepmark, tmp_path: Path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "orchestrate", "launch", str(TINY), "--gpus", "2", "--run-dir", str(run_dir),
         "--set", f"train.output_dir={tmp_path}", "--set", "train.max_steps=4", "--set", "train.eval_every=0",
         "--set", "train.seq_len=32", "--set", "train.global_batch_size=4"],
        cwd=REPO, env=stepmark, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["marked_steps"] for r in records] == [r["step"] for r in records] == [1, 2, 3, 4]
