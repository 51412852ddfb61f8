"""A GRPO run resumed from a checkpoint ends bit-identical to the uninterrupted run (slow, 2 gloo ranks):
the sampling draws from each rank's torch generator, whose state the checkpoint keeps, so the resumed
steps sample the same completions; with num_iterations 2 (cycles of two steps) a checkpoint at the end
of a cycle resumes exactly. One taken mid-cycle does not hold that cycle's rollouts: the resumed run
samples afresh there and then keeps the uninterrupted run's cycles (docs/grpo.md, "Limits")."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
import yaml

from tests.e2e.test_fault_tolerance import _launch, _metrics, _roll_back, _weights

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo"
REWARDS = [{"kind": "format", "pattern": "[aeiou]"}, {"kind": "exact_match", "column": "answer", "pattern": "^([^\\n]*)"}]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> tuple[Path, Path]:
    """(config, run directory) of an uninterrupted 6-step run with a checkpoint after every step."""
    root = tmp_path_factory.mktemp("grpo-resume")
    train, held = runpy.run_path(str(EXAMPLE / "make_prompts.py"))["make"](64, 8, 0)
    for name, rows in (("prompts.jsonl", train), ("held_out.jsonl", held)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = yaml.safe_load((EXAMPLE / "model.yaml").read_text())
    config["train"].update(max_steps=6, eval_every=3, checkpoint_every=1, keep_checkpoints=6, output_dir=str(root))
    config["data"].update(train_files=[str(root / "prompts.jsonl")], validation_files=[str(root / "held_out.jsonl")])
    config["grpo"].update(rewards=REWARDS, num_iterations=2)
    config["strategy"] = {"backend": "ddp"}
    path = root / "grpo.yaml"
    path.write_text(yaml.safe_dump(config))
    code, out = _launch(path, root / "whole")
    assert code == 0, out[-3000:]
    return path, root / "whole"


def _resume(whole: tuple[Path, Path], at: int, into: Path) -> list[dict]:
    path, run = whole
    resumed = _roll_back(run, into, at)
    code, out = _launch(path, resumed, 2, "--resume")
    assert code == 0, out[-3000:]
    assert f"from step {at}" in out
    records = _metrics(resumed)
    assert [r["step"] for r in records] == list(range(1, 7))
    return records


def test_a_run_resumed_at_the_end_of_a_cycle_samples_and_trains_exactly_as_the_uninterrupted_one(whole, tmp_path):
    records = _resume(whole, 2, tmp_path / "resumed")
    got, want = _weights(tmp_path / "resumed" / "model"), _weights(whole[1] / "model")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), "weights differ from the uninterrupted run"
    keys = ("loss", "grad_norm", "reward", "completions/mean_length", "clip_ratio", "eval_reward")
    assert [{k: r.get(k) for k in keys} for r in records] == [{k: r.get(k) for k in keys} for r in _metrics(whole[1])]
    assert [("reward" in r) for r in records] == [True, False] * 3  # sampled at steps 1, 3, 5; kept at 2, 4, 6
    assert any(r["grad_norm"] > 0 for r in records[2:])  # the resumed steps trained


def test_a_run_resumed_mid_cycle_samples_afresh_and_keeps_the_uninterrupted_run_s_cycles(whole, tmp_path):
    """The rollouts of step 3 are not in the checkpoint of step 3: step 4 samples new ones, and step 5
    starts a cycle as in the uninterrupted run (the objective counts steps from the run's start)."""
    records = _resume(whole, 3, tmp_path / "resumed")
    assert [("reward" in r) for r in records] == [True, False, True, True, True, False]
