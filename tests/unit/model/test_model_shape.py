"""Model shapes measured on the meta device against public parameter counts.

The configs are built inline from each model's public config.json hyper-parameters (no downloads).
Every expected total was checked two ways: it is the count the Hub lists for the checkpoint, and it
is the closed-form sum of the layer shapes (see `_llama_block` and the gpt2 comment below).
"""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from transformers import AutoConfig

from orchestrate.config.load import config_from_dict, load_config
from orchestrate.errors import UserError
from orchestrate.model.meta import build_meta_model, load_model_config, shape_for

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TRAIN = {"seq_len": 128, "global_batch_size": 8}

# Public config.json hyper-parameters (Hub repo in each comment).
GPT2 = dict(model_type="gpt2")  # openai-community/gpt2: the GPT2Config defaults
TINYLLAMA = dict(model_type="llama", hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, intermediate_size=5632, vocab_size=32000,
                 max_position_embeddings=2048)  # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T
LLAMA2_7B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                 max_position_embeddings=4096)  # meta-llama/Llama-2-7b-hf
MISTRAL_7B = dict(model_type="mistral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
                  max_position_embeddings=32768)  # mistralai/Mistral-7B-v0.1
QWEN2_05B = dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                 max_position_embeddings=32768, tie_word_embeddings=True)  # Qwen/Qwen2-0.5B
PHI3_MINI = dict(model_type="phi3", hidden_size=3072, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, intermediate_size=8192, vocab_size=32064,
                 max_position_embeddings=4096)  # microsoft/Phi-3-mini-4k-instruct


def _llama_block(h: int, heads: int, kv_heads: int, inter: int, qkv_bias: bool = False) -> int:
    """One llama-style block: q,k,v,o projections (GQA: k,v have kv_heads), SwiGLU MLP, two RMSNorms.

    Phi-3 fuses qkv and gate/up into one matrix each: same count. Qwen2 adds biases to q, k, v.
    """
    kv = kv_heads * (h // heads)
    attention = h * (h + 2 * kv) + h * h + ((h + 2 * kv) if qkv_bias else 0)
    return attention + 3 * h * inter + 2 * h


# (arch, Hub-listed total, one block, embedding, lm_head, final norm)
CASES = {
    # GPT-2 block: c_attn 3h^2+3h, attn c_proj h^2+h, c_fc 4h^2+4h, mlp c_proj 4h^2+h, two LayerNorms 4h
    # = 12h^2 + 13h; wte + wpe embeddings, lm_head tied to wte, ln_f 2h.
    "gpt2": (GPT2, 124_439_808, 12 * 768**2 + 13 * 768, (50257 + 1024) * 768, 0, 2 * 768),
    "tinyllama-1.1b": (TINYLLAMA, 1_100_048_384, _llama_block(2048, 32, 4, 5632),
                       32000 * 2048, 32000 * 2048, 2048),
    "llama2-7b": (LLAMA2_7B, 6_738_415_616, _llama_block(4096, 32, 32, 11008), 32000 * 4096, 32000 * 4096, 4096),
    "mistral-7b-v0.1": (MISTRAL_7B, 7_241_732_096, _llama_block(4096, 32, 8, 14336),
                        32000 * 4096, 32000 * 4096, 4096),
    "qwen2-0.5b": (QWEN2_05B, 494_032_768, _llama_block(896, 14, 2, 4864, qkv_bias=True), 151936 * 896, 0, 896),
    "phi3-mini-4k": (PHI3_MINI, 3_821_079_552, _llama_block(3072, 32, 32, 8192),
                     32064 * 3072, 32064 * 3072, 3072),
}


def _run_config(model: dict, source_dir: Path | None = None):
    return config_from_dict({"model": model, "train": TRAIN}, source_dir)


@pytest.mark.parametrize("name", CASES)
def test_parameter_counts_match_public_numbers(name):
    arch, total, block, embedding, lm_head, final_norm = CASES[name]
    shape = shape_for(_run_config({"architecture": arch}))
    assert shape.parameters == total
    assert shape.block_parameters == block
    assert shape.embedding_parameters == embedding
    assert shape.lm_head_parameters == lm_head
    # Nothing is counted twice or missed: the parts add up to the total.
    assert embedding + lm_head + shape.num_layers * block + final_norm == total


def test_dimensions_gqa_and_gpt2_naming():
    tiny = shape_for(_run_config({"architecture": TINYLLAMA}))
    assert (tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.num_kv_heads, tiny.head_dim) == (2048, 22, 32, 4, 64)
    assert (tiny.intermediate_size, tiny.vocab_size, tiny.max_position_embeddings) == (5632, 32000, 2048)
    assert not tiny.tied_embeddings

    gpt2 = shape_for(_run_config({"architecture": GPT2}))
    assert (gpt2.hidden_size, gpt2.num_layers, gpt2.num_heads, gpt2.num_kv_heads, gpt2.head_dim) == (768, 12, 12, 12, 64)
    assert (gpt2.intermediate_size, gpt2.max_position_embeddings) == (4 * 768, 1024)  # n_inner null -> 4 * n_embd
    assert gpt2.tied_embeddings
    assert shape_for(_run_config({"architecture": {**GPT2, "n_inner": 1000}})).intermediate_size == 1000


def test_largest_layer_is_the_llama_7b_embedding():
    assert shape_for(_run_config({"architecture": LLAMA2_7B})).largest_layer_parameters == 32000 * 4096


def test_untying_adds_an_lm_head():
    tied = shape_for(_run_config({"architecture": QWEN2_05B}))
    untied = shape_for(_run_config({"architecture": {**QWEN2_05B, "tie_word_embeddings": False}}))
    assert tied.tied_embeddings and not untied.tied_embeddings
    assert tied.lm_head_parameters == 0
    assert untied.lm_head_parameters == 151936 * 896
    assert untied.parameters - tied.parameters == 151936 * 896


def test_meta_model_holds_no_memory_and_keeps_ties():
    model = build_meta_model(AutoConfig.for_model(**GPT2))
    assert all(p.device == torch.device("meta") for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight


def test_local_directory_with_config_json(tmp_path):
    AutoConfig.for_model(**TINYLLAMA).save_pretrained(tmp_path / "tinyllama")
    by_absolute = shape_for(_run_config({"name_or_path": str(tmp_path / "tinyllama")}))
    by_relative = shape_for(_run_config({"name_or_path": "tinyllama"}, source_dir=tmp_path))
    assert by_absolute.parameters == by_relative.parameters == 1_100_048_384


def _problem(exc: pytest.ExceptionInfo[UserError]):
    assert len(exc.value.problems) == 1
    return exc.value.problems[0]


def test_directory_without_config_json(tmp_path):
    with pytest.raises(UserError) as exc:
        load_model_config(_run_config({"name_or_path": str(tmp_path)}))
    assert _problem(exc).where == "model.name_or_path"
    assert "config.json" in _problem(exc).message


def test_unreadable_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError) as exc:
        load_model_config(_run_config({"name_or_path": str(tmp_path)}))
    assert _problem(exc).where == "model.name_or_path"
    assert _problem(exc).message.startswith(f"cannot read {tmp_path / 'config.json'}")


def test_missing_local_path(tmp_path):
    with pytest.raises(UserError) as exc:
        load_model_config(_run_config({"name_or_path": "./no-such-model"}, source_dir=tmp_path))
    assert _problem(exc).where == "model.name_or_path"
    assert "does not exist" in _problem(exc).message


def test_hub_name_without_network(monkeypatch, tmp_path):
    # Offline mode makes transformers fail at once, as it does (after retries) without a network.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as exc:
        load_model_config(_run_config({"name_or_path": "no-such-org/no-such-model"}, source_dir=tmp_path))
    assert _problem(exc).where == "model.name_or_path"
    assert "not a local directory" in _problem(exc).message


def test_unknown_model_type_inline():
    with pytest.raises(UserError) as exc:
        load_model_config(_run_config({"architecture": {"model_type": "no-such-type"}}))
    assert _problem(exc).where == "model.architecture.model_type"
    assert "no-such-type" in _problem(exc).message


def test_unknown_model_type_in_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-type"}')
    with pytest.raises(UserError) as exc:
        load_model_config(_run_config({"name_or_path": str(tmp_path)}))
    assert _problem(exc).where == "model.name_or_path"
    assert "no-such-type" in _problem(exc).message


def test_invalid_architecture_value():
    with pytest.raises(UserError) as exc:
        load_model_config(_run_config({"architecture": {**TINYLLAMA, "hidden_size": 100, "num_attention_heads": 3}}))
    assert _problem(exc).where == "model.architecture"


def test_model_without_causal_lm_class():
    with pytest.raises(UserError) as exc:
        shape_for(_run_config({"architecture": {"model_type": "t5"}}))
    assert "t5" in _problem(exc).message.lower()


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load_and_yield_a_shape(path):
    shape = shape_for(load_config(path))
    assert shape.parameters > 0
    assert shape.num_layers * shape.block_parameters < shape.parameters


def test_example_shapes():
    tiny = shape_for(load_config(EXAMPLES / "tiny-gpt2.yaml"))
    assert tiny.vocab_size == 257  # the built-in byte tokenizer: 256 bytes + end-of-document
    assert tiny.parameters < 1_000_000  # trains on 2 CPU cores in minutes
    assert shape_for(load_config(EXAMPLES / "gpt2-xl.yaml")).parameters == 1_557_611_200
    assert shape_for(load_config(EXAMPLES / "llama-1.1b.yaml")).parameters == 1_100_048_384
    assert shape_for(load_config(EXAMPLES / "llama2-7b.yaml")).parameters == 6_738_415_616
