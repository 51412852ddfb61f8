"""The byte tokenizer saved as a Hugging Face tokenizer round-trips through AutoTokenizer and
pipeline("text-generation"); a model directory's own tokenizer is used by default."""

from __future__ import annotations

import json
import textwrap
import warnings

import pytest

from orchestrate.config.load import load_config
from orchestrate.data.tokenizer import BYTE_EOS, ByteTokenizer, save_tokenizer
from orchestrate.data.tokenizer_choice import tokenizer_dir_of

TEXTS = ["hello world", "héllo wörld — ünïcödé 🙂 中文", "  leading spaces\nand\ttabs\r\n", "", "<|endoftext|> literal"]


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    save_tokenizer(None, out)
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_auto_tokenizer_ids_equal_the_byte_tokenizer(byte_dir, text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(byte_dir))
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == ByteTokenizer().encode(text)
    assert tok.decode(ids) == text


def test_special_token_is_the_byte_eos(byte_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(byte_dir))
    assert tok.eos_token_id == BYTE_EOS and len(tok) == ByteTokenizer.vocab_size
    assert tok.decode([104, 105, BYTE_EOS], skip_special_tokens=True) == "hi"


def test_text_generation_pipeline_round_trips(byte_dir):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, pipeline

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=64, vocab_size=257,
                                       bos_token_id=BYTE_EOS, eos_token_id=BYTE_EOS))
    model.save_pretrained(str(byte_dir))
    generate = pipeline("text-generation", model=str(byte_dir), device="cpu")
    out = generate("héllo", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert out.startswith("héllo") and len(out.encode("utf-8", errors="replace")) > len("héllo".encode())


def test_copies_a_tokenizer_directory(tmp_path, byte_dir):
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    save_tokenizer(byte_dir, out)
    assert AutoTokenizer.from_pretrained(str(out)).encode("ab", add_special_tokens=False) == [97, 98]


CONFIG = """\
model:
  name_or_path: {model}
train:
  seq_len: 16
  global_batch_size: 2
  output_dir: runs  # beside this file, in the test's tmp_path (the tokenizer memo is cached under it)
"""


def _model_dir(tmp_path, tokenizer: bool, weights: bool):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 257}))
    if tokenizer:
        save_tokenizer(None, model)
    if weights:
        (model / "model.safetensors").write_bytes(b"")
    path = tmp_path / "model.yaml"
    path.write_text(textwrap.dedent(CONFIG.format(model=model)))
    return load_config(path), model


def test_model_directory_tokenizer_is_the_default(tmp_path):
    config, model = _model_dir(tmp_path, tokenizer=True, weights=True)
    assert tokenizer_dir_of(config) == model


def test_data_tokenizer_wins_over_the_model_directory(tmp_path, byte_dir):
    config, _ = _model_dir(tmp_path, tokenizer=True, weights=False)
    config.data.tokenizer = str(byte_dir)
    assert tokenizer_dir_of(config) == byte_dir


def test_pretrained_weights_with_the_byte_tokenizer_warn(tmp_path):
    config, _ = _model_dir(tmp_path, tokenizer=False, weights=True)
    with pytest.warns(UserWarning, match="byte tokenizer"):
        assert tokenizer_dir_of(config) is None


def test_no_weights_no_tokenizer_is_quiet(tmp_path):
    config, _ = _model_dir(tmp_path, tokenizer=False, weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tokenizer_dir_of(config) is None


def test_data_pipeline_tokenises_with_the_model_directory_tokenizer(tmp_path):
    from orchestrate.data.pipeline import tokenizer_for

    config, model = _model_dir(tmp_path, tokenizer=True, weights=True)
    tokenizer, directory = tokenizer_for(config, 257)
    assert directory == model and tokenizer.encode("hé") == list("hé".encode()) and tokenizer.eos_id == BYTE_EOS
