"""The preference method's memory terms are what its code allocates, measured with the storage counter
(orchestrate/simulate/counter.py): the answer log-probabilities cost exactly the task cross-entropy's
temporaries (so the planner's logits term covers them), chunked as the chunked cross-entropy's, a
no_grad reference forward the measured constant (chunked: one chunk's), and a live reference adds
nothing to a step's peak beyond its weights."""

from __future__ import annotations

import pytest
import torch

from orchestrate.methods.preference.config import PreferenceSection
from orchestrate.methods.preference.losses import AnswerLogps, next_labels, target_logps, token_logps
from orchestrate.methods.preference.memory import (
    REFERENCE_FORWARD_BYTES_PER_TOKEN_VOCAB,
    chunked_reference_forward_bytes,
    reference_forward_bytes,
)
from orchestrate.methods.preference.objective import PreferenceObjective
from orchestrate.methods.preference.reference import module_reference
from orchestrate.simulate.counter import LiveStorageCounter
from orchestrate.worker.chunked_loss import chunked_cross_entropy, over_chunks

B, S, V = 4, 64, 4096
H, CHUNKS = 32, 4


def _peak(fn) -> int:
    counter = LiveStorageCounter()  # counts what `fn` allocates; its inputs were made before
    with counter:
        fn()
    return counter.peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_answer_log_probs_cost_what_the_task_cross_entropy_costs(dtype):
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits = torch.randn(B, S, V, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (B, S))
    labels[:, :10] = -100
    task = _peak(lambda: ForCausalLMLoss(logits, labels, V).backward())
    logits.grad = None
    ours = _peak(lambda: token_logps(logits, labels)[0].sum().backward())
    assert ours == task


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_reference_forward_s_log_probs_take_the_measured_bytes(dtype):
    logits = torch.randn(B, S, V, dtype=dtype)
    labels = torch.randint(0, V, (B, S))
    with torch.no_grad():
        peak = _peak(lambda: token_logps(logits, labels))
    assert peak == pytest.approx(REFERENCE_FORWARD_BYTES_PER_TOKEN_VOCAB * B * S * V, rel=0.01)


def _hidden_and_head(dtype, requires_grad: bool):
    torch.manual_seed(0)
    hidden = torch.randn(B, S, H, dtype=dtype, requires_grad=requires_grad)
    head = torch.nn.Linear(H, V, bias=False, dtype=dtype).requires_grad_(requires_grad)
    labels = torch.randint(0, V, (B, S))
    labels[:, :10] = -100
    return hidden, head, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_answer_log_probs_cost_what_the_chunked_cross_entropy_costs(dtype):
    hidden, head, labels = _hidden_and_head(dtype, requires_grad=True)
    task = _peak(lambda: chunked_cross_entropy(hidden, head, labels, CHUNKS).backward())
    hidden.grad, head.weight.grad = None, None
    ours = _peak(lambda: torch.cat(over_chunks(target_logps, hidden, head, next_labels(labels), CHUNKS),
                                   dim=1).sum().backward())
    # the same chunk temporaries; beyond them only the per-position values (B x S fp32, 1 KiB here)
    assert task <= ours <= task + B * S * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunked_reference_forward_holds_one_chunk_s_log_probs(dtype):
    hidden, head, labels = _hidden_and_head(dtype, requires_grad=False)
    with torch.no_grad():
        peak = _peak(lambda: over_chunks(target_logps, hidden, head, next_labels(labels), CHUNKS))
    # the counter sees the pre-existing head weight once the matmul views it (its transpose)
    measured = peak - head.weight.numel() * head.weight.element_size()
    one_chunk = reference_forward_bytes(B * S // CHUNKS, V, hidden.element_size())
    # bf16: the priced constant exactly (2 + 8 B per position and vocabulary entry); fp32 measures 8 of the 12
    assert one_chunk * 0.6 < measured <= one_chunk * 1.01
    shape = type("Shape", (), {"vocab_size": V, "hidden_size": H})()
    priced = chunked_reference_forward_bytes(shape, B, S, CHUNKS, hidden.element_size())
    assert priced == one_chunk + hidden.numel() * hidden.element_size()  # the hidden states the chunks read


def test_a_live_reference_adds_nothing_to_the_step_s_peak_beyond_its_weights():
    from transformers import LlamaConfig, LlamaForCausalLM

    def llama(seed: int):
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=V))

    model, reference = llama(0), llama(1).eval().requires_grad_(False)
    ids = torch.randint(0, V, (2 * B, S))
    labels = ids.clone()
    labels[:, :8] = -100
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids),
             "sequence": torch.arange(2 * B).unsqueeze(1).expand(2 * B, S).contiguous(),
             "record_index": torch.arange(B)}
    with torch.no_grad():
        cached = module_reference(reference)(reference, batch)
    peaks = {}
    for name, source in (("live", module_reference(reference)), ("cached", lambda _model, _batch: AnswerLogps(
            cached.logps.clone(), cached.tokens.clone()))):
        objective = PreferenceObjective(PreferenceSection(), source)
        model.zero_grad(set_to_none=True)
        peaks[name] = _peak(lambda objective=objective: objective.loss(model, batch).backward())
    # The counter sees a pre-existing weight once an op views it (the transposes of matmul weights):
    # the difference is at most the reference's weights, which the planner counts apart.
    weights = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert 0 <= peaks["live"] - peaks["cached"] <= weights
