"""Chunked answer log-probabilities (`train.loss_chunks` under `preference:`, objective.answer_logps):
on tiny models from config, padded and packed batches, the model's and a live reference's log-probabilities,
the loss and every gradient are the unchunked ones within 1e-6, and the chunked step never holds the full
logits (its peak is lower by at least one fp32 copy of them)."""

from __future__ import annotations

import pytest
import torch

from orchestrate.methods.preference.config import PreferenceSection
from orchestrate.methods.preference.objective import PreferenceObjective, answer_logps
from orchestrate.methods.preference.reference import adapter_reference, module_reference
from orchestrate.simulate.counter import LiveStorageCounter
from tests.methods.preference.test_preference_objective import _model, _views

CHUNKS = 3  # uneven: 16 positions (32 packed) in chunks of 6, 6, 4 (11, 11, 10)
TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}


def _step(model, batch, reference, chunks: int):
    """(loss, logged sums, gradients) of one preference step, the model's and reference's log-probs in `chunks`."""
    objective = PreferenceObjective(PreferenceSection(), module_reference(reference, chunks), loss_chunks=chunks)
    model.zero_grad(set_to_none=True)
    loss = objective.loss(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), objective.take_sums(), grads


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("packing", [False, True])
def test_chunked_log_probabilities_loss_and_gradients_are_the_unchunked_ones(tmp_path, family, packing):
    model, reference = _model(family, 0), _model(family, 1).requires_grad_(False)
    batch = _views(tmp_path, packing).batch([0, 1, 2])
    with torch.no_grad():
        whole, chunked = answer_logps(reference, batch), answer_logps(reference, batch, CHUNKS)
    torch.testing.assert_close(chunked.logps, whole.logps, **TOLERANCE)
    torch.testing.assert_close(chunked.tokens, whole.tokens, rtol=0, atol=0)
    loss, sums, grads = _step(model, batch, reference, 0)
    chunked_loss, chunked_sums, chunked_grads = _step(model, batch, reference, CHUNKS)
    torch.testing.assert_close(chunked_loss, loss, **TOLERANCE)
    assert chunked_sums.keys() == sums.keys()
    for key, value in sums.items():
        torch.testing.assert_close(chunked_sums[key], value, **TOLERANCE, msg=key)
    assert chunked_grads.keys() == grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, **TOLERANCE, msg=name)


def test_a_chunked_adapter_reference_is_the_unchunked_one(tmp_path):
    peft = pytest.importorskip("peft")
    policy = peft.get_peft_model(_model("llama", 0), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
    batch = _views(tmp_path, True).batch([0, 1])
    with torch.no_grad():
        whole, chunked = adapter_reference()(policy, batch), adapter_reference(CHUNKS)(policy, batch)
    torch.testing.assert_close(chunked.logps, whole.logps, **TOLERANCE)


def test_the_chunked_step_never_holds_the_full_logits():
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, rows, seq = 4096, 8, 64
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab))
    reference = LlamaForCausalLM(model.config).eval().requires_grad_(False)
    ids = torch.randint(0, vocab, (rows, seq))
    labels = ids.clone()
    labels[:, :8] = -100
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids),
             "sequence": torch.arange(rows).unsqueeze(1).expand(rows, seq).contiguous(),
             "record_index": torch.arange(rows // 2)}
    peaks = {}
    for chunks in (0, 8):
        objective = PreferenceObjective(PreferenceSection(), module_reference(reference, chunks), loss_chunks=chunks)
        model.zero_grad(set_to_none=True)
        with LiveStorageCounter() as counter:
            objective.loss(model, batch).backward()
        peaks[chunks] = counter.peak
    assert peaks[8] < peaks[0] - rows * seq * vocab * 4  # at least one fp32 copy of the full logits less
