"""A data-cache hit imports no heavy library: `orchestrate prepare` twice in fresh interpreters.

The first call tokenises (a miss); the second must find the entry and import neither torch nor
datasets (nor transformers/tokenizers for a Hugging Face tokenizer, whose vocab_size and EOS id
come from the memo the miss wrote). A changed corpus is a miss again.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from orchestrate.data.tokenizer import HFTokenizer
from tests.helpers.imports import ROOT, run_cli
from tests.helpers.word_tokenizers import word_tokenizer


def _prepare(yaml_path: Path):
    run = run_cli("prepare", str(yaml_path), cwd=yaml_path.parent)
    assert run.code == 0, run.output
    return run


def test_second_demo_prepare_is_a_hit_without_torch_or_datasets(tmp_path: Path):
    config = shutil.copy(ROOT / "examples" / "tiny-gpt2.yaml", tmp_path / "tiny-gpt2.yaml")
    first = _prepare(config)
    assert "tokenised train" in first.output and "datasets" in first.heavy
    second = _prepare(config)
    assert "cache hit" in second.output and second.heavy == []
    # Same entry, same counts: the hit opened what the miss wrote.
    assert first.output.split("tokens in")[1] == second.output.split("tokens in")[1]


WORDS = ["the", "cat", "sat", "on", "mat"]


@pytest.mark.slow  # seconds of replays or real tokenizer runs: kept out of the fast tier
def test_hf_tokenizer_hit_loads_no_tokenizer_and_a_changed_corpus_misses(tmp_path: Path):
    word_tokenizer(tmp_path / "tok", WORDS)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\n\n" * 200)
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"architecture": {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1,
                                   "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 64,
                                   "max_position_embeddings": 64}},
        "train": {"seq_len": 16, "global_batch_size": 4},
        "data": {"train_files": ["corpus.txt"], "tokenizer": "tok", "num_proc": 1}}))
    first = _prepare(config)
    assert "tokenised train" in first.output and "transformers" in first.heavy
    second = _prepare(config)
    assert "cache hit" in second.output and second.heavy == []
    corpus.write_text("the mat sat on the cat\n\n" * 150)
    third = _prepare(config)
    assert "tokenised train" in third.output and "1,050 tokens" in third.output  # 150 docs x (6 words + EOS)


def test_remembered_tokenizer_has_the_same_fingerprint_and_ids(tmp_path: Path):
    directory = word_tokenizer(tmp_path / "tok", WORDS)
    plain = HFTokenizer(directory)
    first = HFTokenizer(directory, tmp_path / "memo")  # loads and writes the memo
    remembered = HFTokenizer(directory, tmp_path / "memo")
    assert remembered._tok is None  # not loaded: vocab_size and eos_id came from the memo
    assert (remembered.vocab_size, remembered.eos_id) == (plain.vocab_size, plain.eos_id) == (len(WORDS) + 2, 1)
    assert remembered.fingerprint() == first.fingerprint() == plain.fingerprint()
    assert remembered.encode("the cat sat") == plain.encode("the cat sat") == [2, 3, 4]


def test_damaged_or_stale_memo_loads_the_tokenizer(tmp_path: Path):
    directory = word_tokenizer(tmp_path / "tok", WORDS)
    HFTokenizer(directory, tmp_path / "memo")
    (memo,) = (tmp_path / "memo").iterdir()
    memo.write_text("{not json")
    again = HFTokenizer(directory, tmp_path / "memo")
    assert again._tok is not None and again.vocab_size == len(WORDS) + 2
    word_tokenizer(directory, [*WORDS, "dog"])  # new files: a new memo key, loaded again
    grown = HFTokenizer(directory, tmp_path / "memo")
    assert grown._tok is not None and grown.vocab_size == len(WORDS) + 3
