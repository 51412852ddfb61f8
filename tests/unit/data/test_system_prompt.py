"""System prompts of chat and instruction records: a record's `system` column (LLaMA-Factory's alpaca and
sharegpt formats have one) and `data.system_prompt` (a default for every sample without one, a source
of `data.datasets` may set its own) become the first turn through the chat template, or the text
before the prompt without one (in place of the Alpaca preamble); both are part of the cache key, and
one given for records without turns is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrate.config.load import config_from_dict
from orchestrate.data.chat_templates import CHATML
from orchestrate.data.pipeline import prepare_data
from orchestrate.errors import UserError
from tests.helpers.chat_tokenizers import word_chat_tokenizer
from tests.helpers.plans import TINY_GPT2
from tests.helpers.sample_rows import sample_rows

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "be", "brief", "kind", "hello", "there", "paris", "say", "hi", "bonjour"]
SYSTEM_TURN = ["<|im_start|>", "system", "be", "brief", "<|im_end|>"]
HELLO = ["<|im_start|>", "user", "hello", "there", "<|im_end|>", "<|im_start|>", "assistant", "paris", "<|im_end|>"]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path: Path, data: dict, seq_len: int = 64):
    arch = {**TINY_GPT2, "vocab_size": 64, "n_positions": 128}
    return config_from_dict({"model": {"architecture": arch}, "train": {"seq_len": seq_len, "global_batch_size": 2},
                             "data": {"num_proc": 1, "packing": False, "validation_ratio": 0.0, **data}}, tmp_path)


def _tokenizer(tmp_path: Path) -> str:
    word_chat_tokenizer(tmp_path / "tok", WORDS, CHATML_SPECIALS, eos="<|im_end|>", template=CHATML.source)
    return "tok"


def _rows(tmp_path: Path, data: dict, **kw) -> list[tuple[list[str], list[str | None]]]:
    """Every training sample as (tokens, labels), in the stream's order."""
    return sample_rows(_config(tmp_path, data, **kw), tmp_path)


def _sharegpt(system: str | None = None) -> dict:
    record = {"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "paris"}]}
    return record if system is None else {**record, "system": system}


def test_a_sharegpt_system_column_is_the_first_turn_and_trains_nothing(tmp_path):
    _jsonl(tmp_path / "sharegpt.jsonl", [_sharegpt("be brief"), _sharegpt()])
    (with_system, labels), (without, _) = _rows(tmp_path, {"train_files": ["sharegpt.jsonl"],
                                                            "tokenizer": _tokenizer(tmp_path)})
    assert with_system == SYSTEM_TURN + HELLO and without == HELLO  # a missing cell (JSON null) is no system
    assert labels == [None] * 12 + ["paris", "<|im_end|>"]


def test_an_alpaca_system_column_is_the_first_turn_of_its_chat(tmp_path):
    _jsonl(tmp_path / "alpaca.jsonl", [{"system": "be brief", "instruction": "say hi", "output": "bonjour"}])
    (tokens, labels), = _rows(tmp_path, {"train_files": ["alpaca.jsonl"], "tokenizer": _tokenizer(tmp_path),
                                         "chat_template": "chatml"})
    assert tokens == SYSTEM_TURN + ["<|im_start|>", "user", "say", "hi", "<|im_end|>",
                                    "<|im_start|>", "assistant", "bonjour", "<|im_end|>"]
    assert labels == [None] * 12 + ["bonjour", "<|im_end|>"]


def test_the_default_system_prompt_fills_only_samples_without_one(tmp_path):
    own_turn = {"conversations": [{"from": "system", "value": "be kind"}, *_sharegpt()["conversations"]]}
    _jsonl(tmp_path / "chats.jsonl", [_sharegpt(), _sharegpt("be kind"), own_turn])
    (default, _), (column, _), (turn, _) = _rows(tmp_path, {"train_files": ["chats.jsonl"], "system_prompt": "be brief",
                                                            "tokenizer": _tokenizer(tmp_path)})
    kind = ["<|im_start|>", "system", "be", "kind", "<|im_end|>"]
    assert default == SYSTEM_TURN + HELLO and column == kind + HELLO and turn == kind + HELLO


def test_a_source_sets_its_own_system_prompt_or_none(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [_sharegpt()])
    _jsonl(tmp_path / "b.jsonl", [_sharegpt()])
    _jsonl(tmp_path / "c.jsonl", [_sharegpt()])
    rows = _rows(tmp_path, {"tokenizer": _tokenizer(tmp_path), "system_prompt": "be brief", "datasets": [
        {"path": "a.jsonl"}, {"path": "b.jsonl", "system_prompt": "be kind"}, {"path": "c.jsonl", "system_prompt": ""}]})
    assert [tokens[:5] for tokens, _ in rows] == [SYSTEM_TURN, ["<|im_start|>", "system", "be", "kind", "<|im_end|>"],
                                                  HELLO[:5]]


def test_without_a_template_the_system_prompt_is_the_text_before_the_prompt(tmp_path):
    _jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Say hi", "output": "Hi"}])
    _jsonl(tmp_path / "pc.jsonl", [{"prompt": "Say hi", "completion": "Hi"}])
    data = {"system_prompt": "Answer briefly.", "datasets": [{"path": "alpaca.jsonl"}, {"path": "pc.jsonl"}]}
    (alpaca, alpaca_labels), (pc, _) = _rows(tmp_path, data, seq_len=256)
    # LLaMA-Factory's alpaca template: the system prompt in the preamble's place
    assert "".join(alpaca) == "Answer briefly.\n\n### Instruction:\nSay hi\n\n### Response:\nHiEOS"
    assert "".join(label for label in alpaca_labels if label) == "HiEOS"
    assert "".join(pc) == "Answer briefly.\n\nSay hiHiEOS"


def test_the_system_prompt_is_part_of_the_cache_key(tmp_path):
    _jsonl(tmp_path / "chats.jsonl", [_sharegpt()])
    tok = _tokenizer(tmp_path)
    entries = {prepare_data(_config(tmp_path, {"train_files": ["chats.jsonl"], "tokenizer": tok, **extra})
                            ).train.directory.name
               for extra in ({}, {"system_prompt": "be brief"}, {"system_prompt": "be kind"},
                             {"columns": {"system": "persona"}})}
    assert len(entries) == 4


@pytest.mark.parametrize(("rows", "data", "where"), [
    ([{"prompt": "hi", "chosen": "yes", "rejected": "no"}], {"system_prompt": "be brief"}, "data.system_prompt"),
    ([{"text": "plain"}], {"datasets": [{"path": "data.jsonl", "system_prompt": "be brief"}]},
     "data.datasets[0].system_prompt"),
])
def test_a_system_prompt_for_records_without_turns_is_refused(tmp_path, rows, data, where):
    _jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(UserError) as err:
        prepare_data(_config(tmp_path, {"train_files": [] if "datasets" in data else ["data.jsonl"], **data}))
    (problem,) = err.value.problems
    assert problem.where == where and "data.jsonl" in problem.message and problem.fix


def test_a_system_column_that_is_no_text_names_the_record(tmp_path):
    _jsonl(tmp_path / "chats.jsonl", [{**_sharegpt(), "system": ["be", "brief"]}])
    with pytest.raises(UserError) as err:
        prepare_data(_config(tmp_path, {"train_files": ["chats.jsonl"], "tokenizer": _tokenizer(tmp_path)}))
    assert "record 0" in err.value.problems[0].message and "'system'" in err.value.problems[0].message
