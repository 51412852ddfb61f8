"""QLoRA's base quantized as it loads (methods/lora/quantized_loading.py): the same NF4 weights and the
same outputs as quantizing a fully loaded model, tied weights and Qwen2's biases included, and a
host peak of about one tensor, not the fp32 model."""

from __future__ import annotations

import pytest
import torch

from orchestrate.methods.lora.transform import add_adapters
from orchestrate.planner.strategy import Strategy
from tests.helpers.plans import make_plan

ARCHS = {"llama": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 257,
                   "max_position_embeddings": 64, "tie_word_embeddings": True},
         "qwen2": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 257,
                   "max_position_embeddings": 64}}


def qlora_plan(arch: dict):
    return make_plan(Strategy("ddp", 0, "none", "none", "fp32", False, 2), ranks=1,
                     config={"model": {"architecture": dict(arch)}, "train": {"method": "qlora"}})


@pytest.mark.parametrize("family", sorted(ARCHS))
def test_quantized_as_it_loads_equals_quantized_after_loading(family, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from orchestrate.loading.weights import load_replicated
    from orchestrate.methods.lora.quantized_loading import load_quantized

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**ARCHS[family])).save_pretrained(tmp_path)
    plan, cpu = qlora_plan(ARCHS[family]), torch.device("cpu")
    loaded, quantized = load_replicated(tmp_path, cpu, torch.float32), load_quantized(tmp_path, cpu, plan)[0]
    torch.manual_seed(1)  # the adapters' random init
    after = add_adapters(loaded, plan)
    torch.manual_seed(1)
    during = add_adapters(quantized, plan)
    a, d = after.state_dict(), during.state_dict()
    assert a.keys() == d.keys()
    for key in a:
        assert torch.equal(a[key], d[key]), key  # NF4 codes, quant states, biases, adapters' init
    assert sum("weight.absmax" in key for key in d) == 2 * 7  # every block linear is 4-bit
    probe = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(during(input_ids=probe).logits, after(input_ids=probe).logits)
    if ARCHS[family].get("tie_word_embeddings"):
        base = during.get_base_model()
        assert base.lm_head.weight is base.model.embed_tokens.weight


BIG = {**ARCHS["llama"], "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 8,
       "num_key_value_heads": 8, "num_hidden_layers": 4}


def test_tensors_live_while_loading_are_not_the_fp32_model(tmp_path):
    """Live tensor bytes (simulate's counter: what the planner's loading term models). Peak RSS is no
    measure here: it also counts the file's mapped pages and what glibc keeps after a free (seen:
    +259 MiB RSS for 41 MiB of live tensors on this 51.7M-parameter model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from orchestrate.loading.weights import load_replicated
    from orchestrate.methods.lora.quantized_loading import load_quantized
    from orchestrate.simulate.counter import LiveStorageCounter

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**BIG)).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp_path)
    del model
    peaks = {}
    for how, load in (("fp32", lambda: load_replicated(tmp_path, torch.device("cpu"), torch.float32)),
                      ("quantized", lambda: load_quantized(tmp_path, torch.device("cpu"), qlora_plan(BIG))[0])):
        with LiveStorageCounter() as counter:
            load()
        peaks[how] = counter.peak
    largest = 1024 * 2816  # the largest tensor (an MLP projection)
    print(f"{params / 1e6:.1f}M params: live tensors at the peak, fp32 load {peaks['fp32'] / 2**20:.0f} MiB, "
          f"quantized load {peaks['quantized'] / 2**20:.0f} MiB (largest tensor fp32 {4 * largest / 2**20:.0f} MiB)")
    assert peaks["fp32"] >= 4 * params
    assert peaks["quantized"] < params  # NF4 base + one tensor in flight: under 1 B/param here
