"""A GRPO run resumed from a checkpoint ends bit-identical to the uninterrupted run, weights and every
step's record (slow, 2 gloo ranks, num_iterations 2: cycles of two steps): the sampling draws from each
rank's torch generator, whose state the checkpoint keeps, so the resumed steps sample the same
completions; a checkpoint inside a cycle also holds each rank's kept rollouts (the objective's state,
ranks/objective-NNNNN.pt), so the cycle's next step trains on them as the uninterrupted run's did.
One uninterrupted run (the module fixture) and one resumed launch per test: after step 1 (inside a
cycle), and after step 2 (a cycle's end) from a checkpoint without the objective's state, as written
before checkpoints held it, which has nothing to keep there and resumes exactly too. A resume inside a
cycle without that state samples afresh, and says so: test_grpo_cycle_state.py (docs/grpo.md, "Resuming")."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
import yaml

from orchestrate.run import checkpoints as rc
from tests.e2e.test_fault_tolerance import _launch, _metrics, _roll_back, _weights

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo"
MEASURED = frozenset({"time", "step_time_s", "tokens_per_s", "loss_tokens_per_s", "cpu_tensor_peak_bytes",
                      "rss_peak_bytes_max_rank", "node_rss_peak_bytes"})
"""A CPU run's record keys that measure the machine (clock, memory), not the training."""
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


def _resume(whole: tuple[Path, Path], at: int, into: Path, without_objective_state: bool = False) -> tuple[list[dict], str]:
    """The uninterrupted run rolled back to the checkpoint of step `at` and resumed: its records and output."""
    path, run = whole
    resumed = _roll_back(run, into, at)
    if without_objective_state:  # as written before checkpoints held it: no file, and a manifest without it
        ckpt = rc.checkpoint_root(resumed) / rc.step_dir_name(at)
        for rank in (0, 1):
            rc.objective_file(ckpt, rank).unlink()
        rc.write_manifest(ckpt)
    code, out = _launch(path, resumed, 2, "--resume")
    assert code == 0, out[-3000:]
    assert f"from step {at}" in out
    records = _metrics(resumed)
    assert [r["step"] for r in records] == list(range(1, 7))
    return records, out


def _assert_trained_as(into: Path, records: list[dict], whole: Path) -> None:
    """The same weights, bit for bit, and the same records (loss, grad_norm, the rewards, lengths,
    clip_ratio, the evaluation's...), but what measures the machine."""
    got, want = _weights(into / "model"), _weights(whole / "model")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), "weights differ from the uninterrupted run"

    def trained(record: dict) -> dict:
        return {k: v for k, v in record.items() if k not in MEASURED}

    expected = _metrics(whole)
    assert [trained(r) for r in records] == [trained(r) for r in expected]
    assert [("reward" in r) for r in records] == [True, False] * 3  # sampled at steps 1, 3, 5; kept at 2, 4, 6
    assert any(r["grad_norm"] > 0 for r in records[2:])  # the resumed steps trained


def test_a_run_resumed_inside_a_cycle_trains_on_the_cycle_s_rollouts_exactly_as_the_uninterrupted_one(
        whole, tmp_path):
    records, out = _resume(whole, 1, tmp_path / "resumed")
    assert "inside a grpo.num_iterations cycle" not in out  # the checkpoint's rollouts were used
    _assert_trained_as(tmp_path / "resumed", records, whole[1])


def test_a_run_resumed_at_a_cycle_s_end_from_a_checkpoint_without_objective_state_trains_exactly_as_the_uninterrupted_one(
        whole, tmp_path):
    records, out = _resume(whole, 2, tmp_path / "resumed", without_objective_state=True)
    assert "inside a grpo.num_iterations cycle" not in out  # a cycle's end: nothing was lost
    _assert_trained_as(tmp_path / "resumed", records, whole[1])
