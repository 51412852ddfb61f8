"""Chunked cross-entropy (worker/chunked_loss.py): the same loss and gradients as the model's own
loss, with a lower peak of live tensors (the full logits never exist)."""

from __future__ import annotations

import pytest
import torch

from orchestrate.simulate.counter import LiveStorageCounter
from orchestrate.worker.objective import CausalLMObjective

VOCAB, SEQ = 4096, 256


def tiny(model_type: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = {"llama": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=64, tie_word_embeddings=False),
            "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=SEQ)}[model_type]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=VOCAB, **arch))
    return model.eval()  # no dropout: the two losses compared see the same forward


def batch(padded: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    if padded:
        labels[1, SEQ // 2:] = -100  # padded positions are left out of the loss
    return {"input_ids": ids, "labels": labels}


def loss_and_grads(model, chunks: int, b) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = CausalLMObjective(chunks).loss(model, b)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
@pytest.mark.parametrize("padded", [False, True])
def test_chunked_loss_and_gradients_equal_the_models_own(model_type, padded):
    model, b = tiny(model_type), batch(padded)
    ref_loss, ref_grads = loss_and_grads(model, 0, b)
    loss, grads = loss_and_grads(model, 8, b)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def peak_bytes(model, chunks: int, b) -> int:
    with LiveStorageCounter() as counter:
        CausalLMObjective(chunks).loss(model, b).backward()
    return counter.peak


def test_chunked_loss_peak_is_lower_by_about_the_logits():
    model, b = tiny("llama"), batch(False)
    model.zero_grad(set_to_none=True)
    whole = peak_bytes(model, 0, b)
    model.zero_grad(set_to_none=True)
    chunked = peak_bytes(model, 8, b)
    logits = 2 * SEQ * VOCAB * 4  # one fp32 copy of the full logits
    print(f"peak unchunked {whole / 2**20:.2f} MiB, 8 chunks {chunked / 2**20:.2f} MiB, "
          f"one fp32 logits copy {logits / 2**20:.2f} MiB")
    assert chunked < whole - logits


def test_activation_offload_wraps_the_forward_in_save_on_cpu_and_changes_no_gradient(monkeypatch):
    """The torch engine's wiring (backends/torch_engine.py), on CPU where it moves nothing: the forward
    runs inside save_on_cpu exactly when the settings say so, and the gradients are the same."""
    from pathlib import Path

    from orchestrate.backends.torch_engine import TorchEngine
    from tests.helpers.engines import cpu_rank

    entered = []
    real = torch.autograd.graph.save_on_cpu

    def recording(*args, **kwargs):
        entered.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", recording)
    model, b = tiny("llama"), batch(False)
    grads = {}
    for offload in (False, True):
        engine = TorchEngine(model, None, None, None, {"activation_offload": offload}, None, None, cpu_rank(), Path("."),
                             CausalLMObjective(4))
        model.zero_grad(set_to_none=True)
        engine._forward_loss(b).backward()
        grads[offload] = [p.grad.clone() for p in model.parameters()]
    assert entered == [{"pin_memory": False}]
    for on, off in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(on, off, rtol=0, atol=0)
