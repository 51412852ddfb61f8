"""Preference tuning end to end through the CLI on 2 gloo ranks (slow), on examples/preference's
generated pairs (the chosen answer is the word in capitals, the rejected one in small letters):
DPO raises the reward accuracy from the ties of the first step (the model is its reference: every
reward 0) to above 0.8 and the held-out pairs' log-prob margin beyond the reference's, under full
fine-tuning, LoRA and QLoRA, and with the log-probabilities in chunks (train.loss_chunks) as without
them; every reference placement this machine can run gives the losses of
`replicated` within 1e-6 (adapter against replicated under LoRA); KTO on the same answers labelled
rewards the desirable ones above the undesirable; a run resumed from its mid-run
checkpoint ends bit-identical and reuses its precomputed reference log-probabilities; with
data.packing a step trains on global_batch_size pairs (the padded run's, to its losses) and resumes
bit-identical too.

Each run is built once per module (a fixture shared by the tests); the learning check with
repeats over seeds is bench/preference_learning.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.test_fault_tolerance import _launch, _metrics, _roll_back, _weights
from tests.helpers.preference import PreferenceRuns

pytestmark = pytest.mark.slow
PLACEMENT_STEPS = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return PreferenceRuns(tmp_path_factory.mktemp("preference"))


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_dpo_prefers_the_rule_s_answers_on_held_out_pairs(runs, method):
    records = _metrics(runs(method, method))
    assert records[0]["rewards/accuracies"] == 0.0 and records[0]["rewards/margins"] == 0.0  # ties: model = reference
    late = [r["rewards/accuracies"] for r in records[-10:]]
    final = [r for r in records if "eval_rewards/margins" in r][-1]
    print(f"{method}: accuracy of the last 10 steps {sum(late) / len(late):.3f}, held-out "
          f"rewards/margins {final['eval_rewards/margins']:.4f}, accuracy {final['eval_rewards/accuracies']:.3f}")
    assert sum(late) / len(late) > 0.8
    # beta x (the held-out log-prob margin now - the reference's): it grew
    assert final["eval_rewards/margins"] > 0 and final["eval_rewards/accuracies"] > 0.8
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert all(key in r for r in records), key
    assert records[-1]["rewards/chosen"] > records[-1]["rewards/rejected"]


def test_chunked_log_probabilities_learn_with_the_unchunked_run_s_losses(runs):
    """LoRA with train.loss_chunks pinned to 2: the model's log-probabilities under checkpoint and the
    adapter reference's under no_grad, chunk by chunk. The frozen LM head has no gradient to sum over
    chunks, and each position's logits and hidden-state gradient are the same rows of the same matmul,
    so the run is the unchunked one's bit for bit (tests/methods/preference/test_preference_chunks.py: 1e-6 on a step)."""
    whole, chunked = runs("lora", "lora"), runs("lora-chunked", "lora", train={"loss_chunks": 2})
    for run_dir, chunks in ((whole, 0), (chunked, 2)):
        plan = json.loads((run_dir / "plan.json").read_text())
        assert next(c for c in plan["candidates"] if c["name"] == plan["chosen"])["strategy"]["loss_chunks"] == chunks
    records = _metrics(chunked)
    assert sum(r["rewards/accuracies"] for r in records[-10:]) / 10 > 0.8  # learns as the unchunked run
    assert _losses(chunked) == _losses(whole)
    assert [r["rewards/margins"] for r in records] == [r["rewards/margins"] for r in _metrics(whole)]
    assert records[-1]["eval_loss"] == _metrics(whole)[-1]["eval_loss"]


def test_kto_rewards_the_desirable_answers_above_the_undesirable_ones(runs):
    records = _metrics(runs("kto", "full", loss="kto"))
    final = [r for r in records if "eval_rewards/margins" in r][-1]
    print(f"kto: held-out rewards desirable {final['eval_rewards/chosen']:.4f}, undesirable "
          f"{final['eval_rewards/rejected']:.4f}, kl {final['eval_kl']:.4f}")
    assert final["eval_rewards/chosen"] > 0 > final["eval_rewards/rejected"]
    assert all(r["rewards/margins"] > 0 for r in records[-10:])


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in _metrics(run_dir)]


@pytest.mark.parametrize(("method", "placement"), [("full", "sharded"), ("full", "precomputed"), ("lora", "adapter")])
def test_every_reference_placement_gives_the_losses_of_replicated(runs, method, placement):
    replicated = runs(f"{method}-replicated", method, PLACEMENT_STEPS, placement="replicated")
    placed = runs(f"{method}-{placement}", method, PLACEMENT_STEPS, placement=placement)
    plan = json.loads((placed / "plan.json").read_text())
    assert next(c for c in plan["candidates"] if c["name"] == plan["chosen"])["reference_placement"] == placement
    assert (placed / "reference_logps").is_dir() == (placement == "precomputed")
    if placement == "precomputed":  # 8 steps read a part of the 400 pairs: the first pass skipped the rest
        computed = ~np.isnan(np.load(placed / "reference_logps" / "train.npy")).any(axis=1)
        assert 0 < computed.sum() < len(computed)
    assert _losses(placed) == pytest.approx(_losses(replicated), abs=1e-6)
    assert _metrics(placed)[-1]["eval_loss"] == pytest.approx(_metrics(replicated)[-1]["eval_loss"], abs=1e-6)


def test_a_resumed_run_is_bit_exact_and_reuses_its_precomputed_reference(runs):
    run_dir = runs("full-precomputed", "full", PLACEMENT_STEPS, placement="precomputed")
    resumed = _roll_back(run_dir, run_dir.parent / "resumed-precomputed", PLACEMENT_STEPS // 2)
    table = resumed / "reference_logps" / "train.npy"
    written = table.stat().st_mtime_ns
    code, out = _launch(run_dir.parent / "full-precomputed.yaml", resumed, 2, "--resume")
    assert code == 0, out[-3000:]
    assert "resumed from" in out
    got, want = _weights(resumed / "model"), _weights(run_dir / "model")
    assert not [k for k in want if not (got[k] == want[k]).all()], "weights differ from the uninterrupted run"
    records = _metrics(resumed)
    assert [r["step"] for r in records] == list(range(1, PLACEMENT_STEPS + 1))
    assert [r["loss"] for r in records] == _losses(run_dir)
    assert [r["rewards/margins"] for r in records] == [r["rewards/margins"] for r in _metrics(run_dir)]
    assert table.stat().st_mtime_ns == written  # the complete first pass of the same data and reference: reused


def test_a_packed_run_trains_on_the_padded_run_s_pairs_each_step(runs):
    """data.packing: true packs each micro-batch's pairs into rows of 2 x seq_len; a step still trains on
    train.global_batch_size pairs, the ones the padded run reads, so the losses are the padded run's."""
    long = {"seq_len": 64}  # a pair takes about a third of a row of 128: two or three share one
    padded = runs("full-64", "full", PLACEMENT_STEPS, train=long)
    packed = runs("full-packed-64", "full", PLACEMENT_STEPS, train=long, data={"packing": True})
    batch = json.loads((packed / "plan.json").read_text())["config"]["train"]["global_batch_size"]
    assert [r["pairs/step"] for r in _metrics(packed)] == [batch] * PLACEMENT_STEPS
    assert [r["pairs/step"] for r in _metrics(padded)] == [batch] * PLACEMENT_STEPS
    assert _losses(packed) == pytest.approx(_losses(padded), abs=1e-5)


def test_a_resumed_packed_run_is_bit_exact(runs):
    """The packed rows of a micro-batch depend on its pairs only: the resumed steps pack them alike."""
    long = {"seq_len": 64}
    run_dir = runs("full-packed-64", "full", PLACEMENT_STEPS, train=long, data={"packing": True})
    resumed = _roll_back(run_dir, run_dir.parent / "resumed-packed", PLACEMENT_STEPS // 2)
    code, out = _launch(run_dir.parent / "full-packed-64.yaml", resumed, 2, "--resume")
    assert code == 0, out[-3000:]
    got, want = _weights(resumed / "model"), _weights(run_dir / "model")
    assert not [k for k in want if not (got[k] == want[k]).all()], "weights differ from the uninterrupted run"
    assert _losses(resumed) == _losses(run_dir)


def test_the_rewards_reach_the_report_and_every_tracker_s_scalars(runs, tmp_path):
    from orchestrate.planner.plan import RunPlan
    from orchestrate.report.summary import write_report
    from orchestrate.worker.scalars import step_scalars

    run_dir = runs("full", "full")
    write_report([run_dir], tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "- rewards (dpo): chosen 0.0000 -> " in summary and "- held-out rewards at step 40: " in summary
    assert "- pairs per step: 8 (train.global_batch_size 8)" in summary
    final = _metrics(run_dir)[-1]
    scalars = step_scalars(final, RunPlan.read(run_dir / "plan.json"))
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert scalars[f"train/{key}"] == final[key] and scalars[f"eval/{key}"] == final[f"eval_{key}"]
