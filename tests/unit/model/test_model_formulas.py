"""The family formulas (`orchestrate.model.formulas`) against the meta-device build, field by field.

The meta build (`orchestrate.model.meta.shape_from_config`) counts the real transformers modules, so
it is the reference; these tests may import torch and transformers, the formula path may not (the
subprocess tests at the end check that `orchestrate plan` never imports them).
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from orchestrate.config.load import config_from_dict
from orchestrate.model.formulas import FAMILIES, shape_from_dict
from orchestrate.model.meta import shape_for, shape_from_config
from tests.helpers.imports import ROOT, run_cli

TRAIN = {"seq_len": 16, "global_batch_size": 8}
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=300,
             max_position_embeddings=128)
GPT2_SMALL = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=128)

# Hand-picked layouts: tied/untied heads, GQA, biases, explicit head_dim, fused projections.
CASES = {
    "gpt2": GPT2_SMALL,
    "gpt2-untied-n_inner": {**GPT2_SMALL, "tie_word_embeddings": False, "n_inner": 100},
    "gpt2-canonical-names": dict(model_type="gpt2", hidden_size=64, num_hidden_layers=3, num_attention_heads=8,
                                 vocab_size=300, max_position_embeddings=32),
    "llama-gqa-biases": dict(model_type="llama", **SMALL, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "llama-tied-head_dim": dict(model_type="llama", **SMALL, tie_word_embeddings=True, head_dim=32),
    "llama-head_dim-null": dict(model_type="llama", **SMALL, head_dim=None, num_key_value_heads=None),
    "mistral": dict(model_type="mistral", **SMALL),
    "mistral-gqa-head_dim": dict(model_type="mistral", **SMALL, num_key_value_heads=2, head_dim=8),
    "qwen2-gqa-tied": dict(model_type="qwen2", **SMALL, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2-head_dim": dict(model_type="qwen2", **SMALL, num_key_value_heads=1, head_dim=24),
    "phi3-gqa": dict(model_type="phi3", **SMALL, num_key_value_heads=2, pad_token_id=None),
    "phi3-tied": dict(model_type="phi3", **SMALL, tie_word_embeddings=True, pad_token_id=0),
    "gemma-mqa-head_dim": dict(model_type="gemma", **SMALL, num_key_value_heads=1, head_dim=24),
    "gemma-bias-untied": dict(model_type="gemma", **SMALL, attention_bias=True, tie_word_embeddings=False),
    "bert": dict(model_type="bert", **SMALL),
    "bert-untied-types": dict(model_type="bert", **SMALL, tie_word_embeddings=False, type_vocab_size=3),
}


def _meta(arch: dict) -> dict:
    return asdict(shape_from_config(AutoConfig.for_model(**arch)))


def _formula(arch: dict) -> dict:
    shape = shape_from_dict(arch)
    assert shape is not None, f"the formulas do not cover {arch}"
    return asdict(shape)


def _same(arch: dict) -> None:
    meta, formula = _meta(arch), _formula(arch)
    assert {k: v for k, v in formula.items() if meta[k] != v} == {}, f"{arch}: meta {meta}"


@pytest.mark.parametrize("name", CASES)
def test_formula_equals_meta_build(name):
    _same(CASES[name])


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_class_defaults_match_transformers(model_type):
    # Each hard-coded default equals the config class's value (derived ones, None in the class,
    # resolve the way its __post_init__ / the modules do); then the default-size model agrees.
    family, cfg = FAMILIES[model_type], AutoConfig.for_model(model_type)
    derived = {"head_dim": cfg.hidden_size // cfg.num_attention_heads,
               "num_key_value_heads": cfg.num_attention_heads, "n_inner": None}
    for key, value in family.defaults.items():
        actual = getattr(cfg, key, None)
        assert actual == value or (value is None and actual in (None, derived[key])), (key, value, actual)
    _same({"model_type": model_type})


@st.composite
def small_arch(draw, model_type: str) -> dict:
    heads = draw(st.integers(1, 4))
    kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    vocab = draw(st.integers(8, 300))
    arch = {"model_type": model_type, "hidden_size": heads * head_dim, "num_hidden_layers": draw(st.integers(1, 3)),
            "num_attention_heads": heads, "vocab_size": vocab, "max_position_embeddings": draw(st.integers(8, 64)),
            "tie_word_embeddings": draw(st.booleans()), "pad_token_id": draw(st.sampled_from([None, 0, vocab - 1]))}
    if model_type == "gpt2":  # no GQA; the MLP width is n_inner (null: 4 * n_embd)
        return arch | {"n_inner": draw(st.sampled_from([None, 12, 40]))}
    if model_type == "bert":
        return arch | {"intermediate_size": draw(st.integers(1, 48)), "type_vocab_size": draw(st.integers(1, 3))}
    arch |= {"num_key_value_heads": kv, "intermediate_size": draw(st.integers(1, 48))}
    if draw(st.booleans()):  # a head_dim of its own, not hidden // heads
        arch["head_dim"] = draw(st.sampled_from([1, 2, 3, 4, 6, 10, 12]))  # RoPE refuses odd ones above 4
    if model_type in ("llama", "gemma"):
        arch["attention_bias"] = draw(st.booleans())
    if model_type == "llama":
        arch["mlp_bias"] = draw(st.booleans())
    return arch


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_small_shapes(model_type, data):
    _same(data.draw(small_arch(model_type)))


@pytest.mark.parametrize("arch", [
    dict(model_type="gpt_neox", **SMALL),  # a family without formulas
    {**GPT2_SMALL, "add_cross_attention": True},  # extra cross-attention modules
    dict(model_type="llama", **SMALL, auto_map={"AutoModelForCausalLM": "x.Y"}),  # custom code
    dict(model_type="gemma", **SMALL, head_dim=None),  # its config class rejects null
    dict(model_type="llama", **{**SMALL, "hidden_size": "64"}),  # wrong type: transformers reports it
    dict(model_type="llama", **{**SMALL, "hidden_size": 66}),  # not a multiple of the heads
    dict(model_type="mistral", **SMALL, head_dim=7),  # RoPE needs an even head_dim
    dict(model_type="phi3", **SMALL),  # default pad_token_id 32000 is outside vocab_size 300
    dict(model_type="llama", **SMALL, tie_word_embeddings="yes"),
    {"hidden_size": 64},  # no model_type
    {"model_type": ["llama"], **SMALL},  # not a name
])
def test_not_covered_falls_back(arch):
    assert shape_from_dict(arch) is None


def test_shape_for_falls_back_to_the_meta_build():
    arch = dict(model_type="gpt_neox", **SMALL)
    run = config_from_dict({"model": {"architecture": arch}, "train": TRAIN})
    assert asdict(shape_for(run)) == _meta(arch)


def test_shape_for_reads_a_local_config_json(tmp_path):
    arch = CASES["qwen2-gqa-tied"]
    (tmp_path / "config.json").write_text(json.dumps(arch))
    run = config_from_dict({"model": {"name_or_path": str(tmp_path)}, "train": TRAIN})
    assert asdict(shape_for(run)) == _meta(arch)


def test_plan_cli_imports_no_torch():
    run = run_cli("plan", "--gpus", "2", str(ROOT / "examples" / "tiny-gpt2.yaml"))
    assert (run.code, run.heavy) == (0, []), run.output


def test_plan_cli_from_a_config_json_imports_no_torch(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(model_type="llama", **SMALL)))
    (tmp_path / "model.yaml").write_text("model: {name_or_path: m}\ntrain: {seq_len: 64, global_batch_size: 8}\n")
    run = run_cli("plan", "--gpus", "1", "--gpu-mem", "8GiB", "--cpu-mem", "16GiB", str(tmp_path / "model.yaml"),
                  cwd=tmp_path)
    assert (run.code, run.heavy) == (0, []), run.output
