"""Data inputs refused with one UserError before work starts: a cache_dir that cannot be written,
num_proc above the cores, 0 training blocks, every sample longer than seq_len, a vocabulary larger
than the corpus gives, seq_len past the model's positions on `plan`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrate.config.load import load_config
from orchestrate.data import checks
from orchestrate.errors import UserError
from orchestrate.planner.plan import RunPlan

ROOT = Path(__file__).resolve().parents[3]
CONFIG = """\
model:
  architecture: {model_type: gpt2, n_embd: 32, n_layer: 1, n_head: 2, n_positions: 256, vocab_size: 257}
train:
  seq_len: 128
  global_batch_size: 2
  output_dir: runs
data:
  train_files: [corpus.txt]
"""


@pytest.fixture
def config_path(tmp_path):
    (tmp_path / "corpus.txt").write_text("hello world\n")
    path = tmp_path / "model.yaml"
    path.write_text(textwrap.dedent(CONFIG))
    return path


def _refused(fn, *args, **kwargs) -> UserError:
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    assert all(p.fix for p in info.value.problems), str(info.value)
    return info.value


def _prepare(config_path, overrides=()):
    from orchestrate.data.pipeline import prepare_from_config
    from orchestrate.methods.registry import method_data

    config = load_config(config_path, list(overrides))
    return prepare_from_config(config, method_data(config), progress=False)


def test_cache_dir_that_is_a_file(config_path):
    (config_path.parent / "cache").write_text("not a directory")
    err = _refused(_prepare, config_path, ["data.cache_dir=cache"])
    assert err.problems[0].where == "data.cache_dir" and "is a file" in err.problems[0].message


def test_cache_dir_under_a_file(config_path):
    (config_path.parent / "cache").write_text("not a directory")
    err = _refused(_prepare, config_path, ["data.cache_dir=cache/sub"])
    assert err.problems[0].where == "data.cache_dir" and "cannot create" in err.problems[0].message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_cache_dir_read_only(config_path):
    ro = config_path.parent / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        err = _refused(_prepare, config_path, ["data.cache_dir=ro"])
    finally:
        ro.chmod(0o700)
    assert "not writable" in err.problems[0].message


def test_cache_dir_not_writable_per_access_check(tmp_path, monkeypatch):
    # As root (CI containers) chmod does not stop writes; os.access is what ensure_cache_dir asks.
    monkeypatch.setattr(checks.os, "access", lambda path, mode: False)
    err = _refused(checks.ensure_cache_dir, tmp_path / "c")
    assert "not writable" in err.problems[0].message


def test_num_proc_above_the_cores_is_refused_before_any_process(config_path):
    err = _refused(_prepare, config_path, ["data.num_proc=100000"])
    assert err.problems[0].where == "data.num_proc" and f"<= {checks.cpu_cores()}" in err.problems[0].fix


def test_prepare_with_no_training_block_is_an_error_with_the_numbers(config_path):
    err = _refused(_prepare, config_path)
    assert "12 tokens" in str(err) and "seq_len 128" in str(err)


def test_prepare_with_one_block_succeeds(config_path):
    assert "1 train" in _prepare(config_path, ["train.seq_len=12", "data.validation_ratio=0"])


def test_vocab_size_beyond_any_corpus_is_refused_before_training(config_path):
    from orchestrate.data.tokenizer_train import train_tokenizer

    config = load_config(config_path)
    err = _refused(train_tokenizer, config, 10**12, config_path.parent / "tok", progress=False)
    assert "at most 2,097,152" in err.problems[0].fix
    err = _refused(train_tokenizer, config, 100_000, config_path.parent / "tok", progress=False)
    assert "12 bytes" in err.problems[0].message


def test_vocab_size_cli_exits_2_not_134(config_path):
    result = subprocess.run([sys.executable, "-m", "orchestrate", "tokenizer", "train", str(config_path),
                             "--vocab-size", "1000000000000", "--out", str(config_path.parent / "tok")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr


def test_plan_refuses_seq_len_past_the_positions(config_path):
    # The check is in the pure planner (make_plan), so `plan` needs no data section and no torch of its own.
    from orchestrate.api import plan_from_file
    from orchestrate.hardware.presets import load_preset

    err = _refused(plan_from_file, config_path, ["train.seq_len=512"], load_preset("rtx3070"))
    assert [(p.where, p.message) for p in err.problems] == [
        ("train.seq_len", "512 is longer than the model's max_position_embeddings 256")]
    assert isinstance(plan_from_file(config_path, ["train.seq_len=256"], load_preset("rtx3070")), RunPlan)


def test_chat_samples_all_longer_than_seq_len_say_so_and_what_to_set(tmp_path):
    """Under data.truncation: drop, every conversation longer than seq_len leaves nothing: `prepare`
    says that and names data.truncation and train.seq_len, not "shorter than one block, add data"."""
    import json

    from orchestrate.data.chat_templates import CHATML
    from tests.helpers.chat_tokenizers import word_chat_tokenizer

    word_chat_tokenizer(tmp_path / "tok", ["user", "assistant", "hello", "there"], ["<|endoftext|>", "<|im_start|>",
                        "<|im_end|>"], eos="<|im_end|>", template=CHATML.source)
    long = " ".join(["hello there"] * 40)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": long}, {"role": "assistant", "content": long}]}) + "\n" for _ in range(4)))
    (tmp_path / "model.yaml").write_text(textwrap.dedent(CONFIG).replace("corpus.txt", "chat.jsonl")
                                         .replace("seq_len: 128", "seq_len: 32")
                                         + "  tokenizer: tok\n  truncation: drop\n  validation_ratio: 0.0\n")
    err = _refused(_prepare, tmp_path / "model.yaml")
    (problem,) = err.problems
    assert problem.where == "data.train_files[0]"
    assert problem.message == "all 4 samples are longer than train.seq_len 32, and data.truncation: drop leaves each out"
    assert "raise train.seq_len, or set data.truncation: keep_answer" in problem.fix
