"""A DeepSpeed ZeRO-1/2 model is saved from host copies of its weights: its 16-bit parameters are
views of one flat buffer, which transformers' save_pretrained would clone where they lie (safetensors
allows no shared storage), a second copy of the weights in GPU memory after the last step (seen in
the H200 check's ZeRO-2 allocation history). Tied weights stay tied."""

from __future__ import annotations

import torch

from orchestrate.backends.hf_io import host_state_dict
from tests.helpers.plans import TINY_GPT2


def _flat_model():
    """A tiny GPT-2 whose parameters are views into one buffer, as DeepSpeed ZeRO-1/2 leaves them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_GPT2)).to(torch.bfloat16)
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return model


def test_host_copies_have_a_storage_each_and_tied_names_share_one():
    model = _flat_model()
    state = model.state_dict()
    host = host_state_dict(state)
    assert host.keys() == state.keys()
    assert all(torch.equal(host[k], state[k]) for k in state)
    assert host["lm_head.weight"] is host["transformer.wte.weight"]
    storages = {t.untyped_storage().data_ptr() for k, t in host.items() if k != "lm_head.weight"}
    assert len(storages) == len(host) - 1


def test_save_pretrained_of_host_copies_clones_nothing_and_reloads_tied(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = _flat_model()
    clones = []
    clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: clones.append(t.shape) or clone(t, *a, **k))
    model.save_pretrained(tmp_path, state_dict=host_state_dict(model.state_dict()))
    monkeypatch.undo()
    assert clones == []
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert torch.equal(loaded.transformer.h[0].mlp.c_fc.weight, model.transformer.h[0].mlp.c_fc.weight)
