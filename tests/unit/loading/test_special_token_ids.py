"""A model built from `model.architecture` carries the run's tokenizer's BOS and EOS ids in the
config.json and generation_config.json it is saved with, not the family's defaults (GPT-2's 50256
is outside a 640-token vocabulary); ids the architecture sets are kept; the tokenizer's pad id is not
given, as it would freeze that token's embedding row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrate.loading.init_weights import build_initial_model
from orchestrate.model.meta import load_model_config
from orchestrate.planner.strategy import Strategy
from tests.helpers.chat_tokenizers import word_chat_tokenizer
from tests.helpers.plans import TINY_GPT2, make_plan

DDP = Strategy("ddp", 0, "none", "none", "fp32", False, 2)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _saved_ids(model_dir: Path) -> tuple[dict, dict]:
    config = json.loads((model_dir / "config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    return ({k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
            {k: generation.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})


def test_a_640_token_gpt2_saves_its_tokenizer_s_eos_not_50256(tmp_path):
    word_chat_tokenizer(tmp_path / "tok", [f"w{i}" for i in range(600)], SPECIALS, eos="<|im_end|>")
    arch = {**TINY_GPT2, "vocab_size": 640}
    plan = make_plan(DDP, 1, {"model": {"architecture": arch}, "data": {"tokenizer": str(tmp_path / "tok")}})
    assert load_model_config(plan.config).eos_token_id is None  # 50256 is no id of this vocabulary
    config, generation = _saved_ids(build_initial_model(plan, tmp_path / "model"))
    eos = SPECIALS.index("<|im_end|>")
    assert config == {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": None}  # no pad: next test
    assert generation["eos_token_id"] == eos and generation["pad_token_id"] is None
    assert all(v is None or v < 640 for v in [*config.values(), *generation.values()])


@pytest.mark.parametrize(("arch", "expected"), [
    ({}, {"bos_token_id": 256, "eos_token_id": 256, "pad_token_id": None}),  # the byte tokenizer's
    ({"eos_token_id": 7, "pad_token_id": 0}, {"bos_token_id": 256, "eos_token_id": 7, "pad_token_id": 0}),
])
def test_the_byte_tokenizer_s_ids_fill_what_the_architecture_leaves_out(tmp_path, arch, expected):
    plan = make_plan(DDP, 1, {"model": {"architecture": {**TINY_GPT2, **arch}}})
    config, generation = _saved_ids(build_initial_model(plan, tmp_path / "model"))
    assert config == expected
    assert generation["eos_token_id"] == expected["eos_token_id"]


def test_the_tokenizer_s_pad_does_not_freeze_its_eos_embedding(tmp_path):
    """A tokenizer whose pad is its EOS (ChatML-style) gives the model no pad_token_id: Llama builds its
    embedding with padding_idx = pad_token_id, a zero row that never learns, and the EOS ends every answer."""
    word_chat_tokenizer(tmp_path / "tok", [f"w{i}" for i in range(40)], SPECIALS, eos="<|im_end|>")
    arch = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    plan = make_plan(DDP, 1, {"model": {"architecture": arch}, "data": {"tokenizer": str(tmp_path / "tok")}})
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_initial_model(plan, tmp_path / "model"))
    embedding = model.get_input_embeddings()
    eos = SPECIALS.index("<|im_end|>")
    assert embedding.padding_idx is None and model.config.pad_token_id is None
    assert float(embedding.weight[eos].abs().sum()) > 0
