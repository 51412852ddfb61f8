"""train.global_batch_size counts preference records, packed or not: the sampler deals records to the
ranks, so every step of 2 ranks x 2 micro-batches x 3 pairs trains on exactly the 12 pairs of its 12
positions in the sampler's stream, with data.packing on and off; packed, a micro-batch's pairs share rows (never more rows than
pairs); the step's loss is the mean over its pairs either way; the step's record counts them
(pairs/step, answers/step for kto)."""

from __future__ import annotations

import pytest
import torch

from orchestrate.data.sampler import DistributedBlockSampler
from orchestrate.methods.preference.callback import records_per_step
from orchestrate.methods.preference.config import PreferenceSection
from orchestrate.methods.preference.losses import pair_loss
from orchestrate.methods.preference.objective import PreferenceObjective, answer_logps
from orchestrate.methods.preference.reference import module_reference
from orchestrate.methods.preference.samples import PackedPreferences, PaddedPreferences
from tests.methods.preference.test_preference_objective import _model, _views

WORLD, ACCUMULATION, MICRO = 2, 2, 3
GLOBAL_BATCH = WORLD * ACCUMULATION * MICRO
PAIRS = 30  # not a multiple of the global batch: steps straddle the epoch's end


def _pairs(n: int) -> list[dict]:
    """Pairs of 13 to 29 tokens together (the byte tokenizer, seq_len 16: nothing cut), so a packed
    block of 32 holds one or two."""
    return [{"prompt": f"Q{i}:", "chosen": "yes" * (1 + i % 3), "rejected": "no" * (1 + i % 5)} for i in range(n)]


def _steps(view, steps: int) -> list[list[dict[str, torch.Tensor]]]:
    """Every micro-batch of each step, over the ranks, as the loop takes them (every rank the same count)."""
    samplers = [DistributedBlockSampler(len(view), rank, WORLD, seed=0) for rank in range(WORLD)]
    return [[view.batch(sampler.take(MICRO)) for sampler in samplers for _ in range(ACCUMULATION)]
            for _ in range(steps)]


def _records(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["record_index"].tolist()


def test_a_step_trains_on_global_batch_size_pairs_packed_or_not(tmp_path):
    padded = _views(tmp_path / "padded", False, rows=_pairs(PAIRS))
    packed = _views(tmp_path / "packed", True, rows=_pairs(PAIRS))
    assert isinstance(padded, PaddedPreferences) and isinstance(packed, PackedPreferences)
    assert len(packed) == len(padded) == PAIRS  # the sampler deals records in both modes
    assert packed.kept.docs.tolist() == padded.kept.docs.tolist() == list(range(PAIRS))  # position k: record k
    stream = DistributedBlockSampler(PAIRS, 0, 1, seed=0)  # the global order: one rank reading whole steps
    shared = 0
    for step, (padded_step, packed_step) in enumerate(zip(_steps(padded, 6), _steps(packed, 6), strict=True)):
        expected = sorted(stream.take(GLOBAL_BATCH))  # the step's 12 stream positions, one record each
        if (step + 1) * GLOBAL_BATCH <= PAIRS:
            assert len(set(expected)) == GLOBAL_BATCH  # within an epoch: 12 distinct pairs
        for mode in (padded_step, packed_step):
            assert sorted(k for batch in mode for k in _records(batch)) == expected
            for batch in mode:  # two sequences per pair, each numbered in the batch
                assert set(batch["sequence"].unique().tolist()) - {-1} == set(range(2 * MICRO))
        for batch in packed_step:
            rows = batch["input_ids"].shape[0]
            assert 1 <= rows <= MICRO and batch["input_ids"].shape[1] == 2 * packed.seq_len
            shared += rows < MICRO
        assert all(b["input_ids"].shape == (2 * MICRO, padded.seq_len) for b in padded_step)
    assert shared  # packing put several pairs in a row


def test_packed_micro_batches_are_the_same_whenever_they_are_read(tmp_path):
    """A resumed sampler reads the same records, so the same blocks: the batch depends on the records only."""
    packed = _views(tmp_path, True, rows=_pairs(PAIRS))
    first = _steps(packed, 3)
    sampler = DistributedBlockSampler(len(packed), 1, WORLD, seed=0)
    sampler.load_state_dict({"epoch": 0, "position": 2 * GLOBAL_BATCH, "seed": 0, "num_blocks": PAIRS})
    again = packed.batch(sampler.take(MICRO))
    want = first[2][ACCUMULATION]  # rank 1's first micro-batch of step 3
    assert again.keys() == want.keys()
    assert all(torch.equal(again[k], want[k]) for k in want)


def test_the_step_loss_is_the_mean_over_its_pairs_packed_or_not(tmp_path):
    model, reference = _model("llama", 0), _model("llama", 1)
    settings = PreferenceSection(loss="dpo")
    whole = _views(tmp_path / "padded", False, rows=_pairs(PAIRS))
    steps = {packing: _steps(_views(tmp_path / str(packing), packing, rows=_pairs(PAIRS)), 1)[0]
             for packing in (False, True)}
    records = [k for batch in steps[False] for k in _records(batch)]
    all_at_once = whole.batch(records)  # one batch of the step's 12 pairs: the loss is their mean
    with torch.no_grad():
        expected = float(pair_loss(settings, answer_logps(model, all_at_once),
                                   answer_logps(reference, all_at_once)).loss)
        for packing, micro_batches in steps.items():
            objective = PreferenceObjective(settings, module_reference(reference))
            # the engine's step: each micro-batch's loss over the accumulation, averaged over the ranks alike
            step = sum(float(objective.loss(model, batch)) for batch in micro_batches) / len(micro_batches)
            assert step == pytest.approx(expected, abs=1e-5), f"packing {packing}"
            sums = {key: float(value) for key, value in objective.take_sums().items()}
            assert records_per_step(sums, settings.loss) == {"pairs/step": GLOBAL_BATCH}


def test_kto_counts_answers_per_step():
    assert records_per_step({"records": 8.0}, "kto") == {"answers/step": 8}
