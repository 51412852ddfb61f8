"""preference.placement precomputed in one process: the first pass stores the reference
log-probabilities of the records the run reads (a training batch reads what the live reference
computes; a run shorter than an epoch computes only the records of its samples, and a batch of others
fails loudly), a pass whose identity is complete is reused as it is, and new data, another seq_len,
a longer run or changed reference weights redo it."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from orchestrate.data.sampler import DistributedBlockSampler
from orchestrate.methods.preference.cache import (
    identity,
    is_complete,
    precomputed_reference,
    records_read,
    write_reference_logps,
)
from orchestrate.methods.preference.objective import answer_logps
from tests.methods.preference.test_preference_objective import _model, _views


@pytest.fixture
def setup(tmp_path):
    reference_dir = tmp_path / "reference"
    _model("llama", 3).save_pretrained(reference_dir)
    view = _views(tmp_path / "data", packing=True)
    from orchestrate.config.load import config_from_dict

    config = config_from_dict({"model": {"architecture": {"model_type": "gpt2", "n_embd": 32, "n_layer": 1,
                                                         "n_head": 2, "vocab_size": 257}},
                               "train": {"seq_len": 16, "global_batch_size": 2}, "preference": {"loss": "dpo"},
                               "data": {"train_files": ["p.jsonl"]}}, tmp_path)
    return tmp_path / "run", reference_dir, view, config


def _every(views):
    return {split: np.arange(view.samples) for split, view in views.items()}


def test_the_first_pass_stores_what_the_live_reference_computes(setup):
    run_dir, reference_dir, view, config = setup
    reference = _model("llama", 3)
    views = {"train": view}
    expected = identity(config, views, _every(views), reference_dir, "fp32", run_dir)
    write_reference_logps(run_dir, expected, views, _every(views), reference, torch.device("cpu"), 0, 1, micro_batch=2)
    assert is_complete(run_dir, expected)
    batch = view.batch(list(range(len(view))))  # packed: the table is read in the packed batch's order
    with torch.no_grad():
        live = answer_logps(reference, batch)
    read = precomputed_reference(run_dir, "train")(reference, batch)
    assert torch.allclose(read.logps, live.logps.float(), atol=1e-5)
    assert torch.equal(read.tokens, live.tokens)


def test_a_complete_pass_is_reused_and_a_changed_input_redoes_it(setup):
    run_dir, reference_dir, view, config = setup
    views = {"train": view}
    every = _every(views)
    expected = identity(config, views, every, reference_dir, "fp32", run_dir)
    write_reference_logps(run_dir, expected, views, every, _model("llama", 3), torch.device("cpu"), 0, 1, micro_batch=2)
    table = run_dir / "reference_logps" / "train.npy"
    written = table.stat().st_mtime_ns
    write_reference_logps(run_dir, expected, views, every, _model("llama", 3), torch.device("cpu"), 0, 1, micro_batch=2)
    assert table.stat().st_mtime_ns == written  # reused
    longer = config.model_copy(update={"train": config.train.model_copy(update={"seq_len": 32})})
    assert not is_complete(run_dir, identity(longer, views, every, reference_dir, "fp32", run_dir))
    assert not is_complete(run_dir, identity(config, views, every, reference_dir, "bf16", run_dir))
    assert not is_complete(run_dir, identity(config, views, {"train": every["train"][:1]}, reference_dir, "fp32", run_dir))
    weights = next(reference_dir.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # retrained
    assert not is_complete(run_dir, identity(config, views, every, reference_dir, "fp32", run_dir))
    other = _views(run_dir.parent / "other", packing=True, rows=[{"prompt": "Z:", "chosen": "a", "rejected": "b"}] * 4)
    others = {"train": other}
    assert not is_complete(run_dir, identity(config, others, _every(others), reference_dir, "fp32", run_dir))


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_a_run_shorter_than_an_epoch_computes_the_records_of_its_samples_only(tmp_path, packing):
    from orchestrate.config.load import config_from_dict
    from tests.methods.preference.test_preference_objective import _pairs

    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    _model("llama", 3).save_pretrained(reference_dir)
    view = _views(tmp_path / "data", packing=packing, rows=_pairs(24))
    config = config_from_dict({"model": {"architecture": {"model_type": "gpt2", "n_embd": 32, "n_layer": 1,
                                                         "n_head": 2, "vocab_size": 257}},
                               "train": {"seq_len": 16, "global_batch_size": 2, "max_steps": 1},
                               "preference": {"loss": "dpo"}, "data": {"train_files": ["p.jsonl"]}}, tmp_path)
    sampler = DistributedBlockSampler(len(view), 0, 1, config.train.seed)
    views = {"train": view}
    records = records_read(views, sampler.blocks_read(config.train.max_steps * config.train.global_batch_size))
    reference = _model("llama", 3)
    write_reference_logps(run_dir, identity(config, views, records, reference_dir, "fp32", run_dir), views, records,
                          reference, torch.device("cpu"), 0, 1, micro_batch=2)
    table = np.load(run_dir / "reference_logps" / "train.npy")
    computed = np.flatnonzero(~np.isnan(table).any(axis=1))
    batch = view.batch(sampler.take(2))  # the run's one step
    assert sorted(batch["record_index"].tolist()) == computed.tolist()
    assert 0 < len(computed) < view.samples  # fewer records than the split holds
    with torch.no_grad():
        live = answer_logps(reference, batch)
    assert torch.allclose(precomputed_reference(run_dir, "train")(reference, batch).logps, live.logps.float(), atol=1e-5)
    others = [p for p in range(len(view)) if not set(view.batch([p])["record_index"].tolist()) & set(computed.tolist())]
    with pytest.raises(RuntimeError, match="no log-probabilities"):
        precomputed_reference(run_dir, "train")(reference, view.batch(others[:1]))
