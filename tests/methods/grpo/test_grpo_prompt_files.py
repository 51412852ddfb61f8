"""GRPO's prompt files are checked where they are read (methods/grpo/prompts.py): a pipe is refused
without reading it; bytes that are no UTF-8, lines that are no JSON object and a lone surrogate
escape (no tokenizer encodes it) are named by file and line; chat messages a template cannot
render are refused with the record before any worker starts. Each is one UserError naming the data
key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrate.config.load import config_from_dict
from orchestrate.errors import UserError
from orchestrate.methods.grpo.prompts import load_prompts
from tests.helpers.plans import TINY_GPT2


def _config(tmp_path: Path):
    return config_from_dict({
        "model": {"architecture": dict(TINY_GPT2)},
        "train": {"seq_len": 32, "global_batch_size": 2},
        "data": {"train_files": ["prompts.jsonl"], "validation_files": ["prompts.jsonl"]},
        "grpo": {"num_generations": 2, "max_completion_length": 8,
                 "rewards": [{"kind": "exact_match", "column": "answer"}]}}, tmp_path)


def _refused(tmp_path: Path) -> UserError:
    with pytest.raises(UserError) as info:
        load_prompts(_config(tmp_path))
    assert [p.where for p in info.value.problems] == ["data.train_files"] and info.value.problems[0].fix
    return info.value


def test_a_pipe_is_refused_without_reading_it(tmp_path):
    os.mkfifo(tmp_path / "prompts.jsonl")
    assert "prompts.jsonl is not a regular file" in str(_refused(tmp_path))


@pytest.mark.parametrize(("body", "says"), [
    (b'{"prompt": "hi", "answer": "yes"}\n{"prompt": "caf\xe9", "answer": "x"}\n',
     "is not UTF-8: byte 49 (0xe9)"),  # in the sniffed head
    (b'{"prompt": "hi", "answer": "yes"}\n' * 40_000 + b'{"prompt": "caf\xe9", "answer": "x"}\n',
     "line 40001: byte 15 (0xe9) is no UTF-8 character"),  # past it
    (b'{"prompt": "hi", "answer": "yes"}\nnull\n', "line 2 holds NoneType, not an object"),
    (b'[1, 2]\n', "line 1 holds list, not an object"),
    (b'{"prompt": "hi", "answer": "yes"}\n{"prompt": \n', "line 2: Expecting value"),
    (b'{"prompt": "caf\\ud800", "answer": "x"}\n', "line 1 holds the lone surrogate U+D800"),
], ids=["not-utf8-in-head", "not-utf8-past-head", "null", "list", "broken-json", "lone-surrogate"])
def test_lines_that_are_no_utf8_json_object_are_named_by_line(tmp_path, body, says):
    (tmp_path / "prompts.jsonl").write_bytes(body)
    assert says in str(_refused(tmp_path))


def test_chat_messages_a_template_cannot_render_are_refused_with_the_record(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": [{"role": "bogus", "content": "hi"}], "answer": "x"}\n')
    err = _refused(tmp_path)
    assert "record 0 its 'prompt' messages: message 0 has role 'bogus'" in str(err)


def test_good_records_are_read(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi", "answer": "yes"}\n\n'
                                            '{"prompt": [{"role": "user", "content": "hi"}], "answer": "no"}\n')
    train, validation = load_prompts(_config(tmp_path))
    assert [r["answer"] for r in train] == ["yes", "no"] and validation == train
