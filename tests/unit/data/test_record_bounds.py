"""Every record and every chat template is held to a bound where it comes in: a text far longer than
seq_len is cut before it is tokenised (counted, its first seq_len tokens unchanged), a long
conversation is split into turns only as far as seq_len reaches, a template that loops, recurses,
includes or multiplies strings without end is one error naming it and the limit, a file that is not
a regular UTF-8 text file is refused before it is parsed, and a malformed `tool_calls` or a missing
class label is refused with the record."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from orchestrate.cli import cli
from orchestrate.config.load import config_from_dict
from orchestrate.data import chat_template
from orchestrate.data.chat_templates import CHATML
from orchestrate.data.pipeline import prepare_data, samples_for
from orchestrate.data.records import record_chars
from orchestrate.errors import UserError
from tests.helpers.chat_tokenizers import word_chat_tokenizer
from tests.helpers.plans import TINY_GPT2

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "hello", "there", "yes", "no"]
PLAIN_CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML without generation markers: its trained tokens are found by rendering turn by turn."""


def _config(tmp_path: Path, data: dict, seq_len: int = 32, task: str = "causal-lm"):
    arch = {**TINY_GPT2, "vocab_size": 64, "n_positions": 128}
    return config_from_dict({"model": {"architecture": arch, "task": task},
                             "train": {"seq_len": seq_len, "global_batch_size": 2},
                             "data": {"num_proc": 1, "packing": False, "validation_ratio": 0.0, **data}}, tmp_path)


def _tokenizer(tmp_path: Path):
    """The saved word tokenizer, loaded (transformers imported here: a slow library)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tmp_path / "tok")


def _chat_data(tmp_path: Path, rows: list[dict], template: str = CHATML.source, **data) -> dict:
    word_chat_tokenizer(tmp_path / "tok", WORDS, SPECIALS, eos="<|im_end|>", template=template)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"train_files": ["chat.jsonl"], "tokenizer": "tok", **data}


def _refused(config) -> UserError:
    with pytest.raises(UserError) as info:
        prepare_data(config)
    assert all(p.fix for p in info.value.problems), str(info.value)
    return info.value


def _turns(*pairs: tuple[str, str]) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


# --- the record budget ---------------------------------------------------------------------------


def test_a_huge_message_is_cut_before_tokenising_and_trains_its_first_seq_len_tokens(tmp_path):
    seq_len = 16
    huge = "hello there " * (20 * record_chars(seq_len))  # ~20x the budget
    rows = [_turns(("user", "yes"), ("assistant", huge)), _turns(("user", "no"), ("assistant", "yes"))]
    config = _config(tmp_path, _chat_data(tmp_path, rows, truncation="truncate"), seq_len=seq_len)
    start = time.perf_counter()
    prepared = prepare_data(config)
    assert time.perf_counter() - start < 30
    assert prepared.train.meta["records_cut"] == 1
    train, _ = samples_for(prepared, config)
    assert train.kept.truncated == 1  # still longer than seq_len for the truncation policy
    first = train.batch([0])["input_ids"][0].tolist()
    tok = _tokenizer(tmp_path)
    whole = tok.apply_chat_template(rows[0]["messages"][:1] + [{"role": "assistant", "content": "hello there " * 40}],
                                    chat_template=CHATML.source, tokenize=False)
    assert first == tok(whole, add_special_tokens=False)["input_ids"][:seq_len]


def test_a_huge_message_is_still_too_long_under_truncation_error(tmp_path):
    rows = [_turns(("user", "yes"), ("assistant", "hello " * (10 * record_chars(16))))]
    config = _config(tmp_path, _chat_data(tmp_path, rows, truncation="error"), seq_len=16)
    with pytest.raises(UserError, match="longer than train.seq_len 16"):
        samples_for(prepare_data(config), config)


def test_a_long_conversation_with_every_role_trained_is_split_only_as_far_as_seq_len(tmp_path):
    turns = [("user", "hello"), ("assistant", "yes")] * 3000  # 6,000 turns: quadratic when rendered to the end
    rows = [_turns(*turns)]
    data = _chat_data(tmp_path, rows, template=PLAIN_CHATML, roles_to_train=["user", "assistant"],
                      truncation="truncate")
    config = _config(tmp_path, data, seq_len=32)
    start = time.perf_counter()
    train, _ = samples_for(prepare_data(config), config)
    assert time.perf_counter() - start < 20
    labels = train.batch([0])["labels"][0].tolist()
    assert sum(x != -100 for x in labels) > 10


def test_tool_calls_as_a_string_is_refused_with_the_record(tmp_path):
    rows = [_turns(("user", "hello"), ("assistant", "yes")),
            {"messages": [{"role": "user", "content": "hello"},
                          {"role": "assistant", "content": None, "tool_calls": "get_weather(paris)"}]}]
    err = _refused(_config(tmp_path, _chat_data(tmp_path, rows)))
    assert "record 1" in str(err) and "'tool_calls' holds str" in str(err)


# --- chat templates --------------------------------------------------------------------------------


@pytest.mark.parametrize(("template", "limit"), [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "longer than"),
    ("{{ 'x' * 4000000000 }}", "multiplies"),
    ("{{ 'x'.ljust(4000000000) }}", "size of 4000000000"),
    ("{{ 'x' | center(4000000000) }}", "size of 4000000000"),
    ("{% include 'other.jinja' %}", "includes or imports"),
    ("{% from 'other.jinja' import m %}", "includes or imports"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nests calls deeper"),
])
def test_a_template_past_a_limit_is_one_error_naming_it_and_the_limit(tmp_path, monkeypatch, template, limit):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)
    (tmp_path / "bad.jinja").write_text(template)
    rows = [_turns(("user", "hello"), ("assistant", "yes"))]
    start = time.perf_counter()
    err = _refused(_config(tmp_path, _chat_data(tmp_path, rows, chat_template="bad.jinja")))
    assert time.perf_counter() - start < 15
    assert err.problems[0].where == "data.chat_template"
    assert "bad.jinja" in err.problems[0].message and limit in err.problems[0].message


def test_a_template_within_the_limits_renders_as_transformers_renders_it(tmp_path):
    word_chat_tokenizer(tmp_path / "tok", WORDS, SPECIALS, eos="<|im_end|>", template=CHATML.source)
    tok = _tokenizer(tmp_path)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]
    for prompt in (False, True):
        text, _ = chat_template.render(chat_template.ChatTemplate(CHATML.source, "chatml"), tok, messages, prompt)
        assert text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


# --- files sniffed before they are parsed -----------------------------------------------------------


def _file_refused(tmp_path: Path, name: str, write) -> UserError:
    write(tmp_path / name)
    return _refused(_config(tmp_path, {"train_files": [name]}))


def test_a_sparse_file_is_refused_at_once(tmp_path):
    def write(path):
        with open(path, "wb") as f:
            f.truncate(2 * 2**30)  # 2 GB of holes
    start = time.perf_counter()
    err = _file_refused(tmp_path, "big.txt", write)
    assert time.perf_counter() - start < 5 and "sparse" in str(err)


def test_a_binary_file_is_refused_at_once(tmp_path):
    err = _file_refused(tmp_path, "data.txt", lambda p: p.write_bytes(b"hello\x00\x01\x02" * 100))
    assert "binary" in str(err) and "data.txt" in str(err)


def test_a_file_not_in_utf8_is_refused_with_the_byte(tmp_path):
    err = _file_refused(tmp_path, "chat.jsonl", lambda p: p.write_bytes(b'{"text": "caf\xe9"}\n'))
    assert "not UTF-8: byte 13 (0xe9)" in str(err)


def test_bytes_not_utf8_past_the_sniffed_head_are_one_error(tmp_path):
    line = json.dumps({"text": "hello there " * 8}).encode() + b"\n"
    body = line * (2**21 // len(line)) + b'{"text": "caf\xe9"}\n'
    err = _file_refused(tmp_path, "chat.jsonl", lambda p: p.write_bytes(body))
    assert "chat.jsonl" in str(err)


def test_a_pipe_is_refused(tmp_path):
    err = _file_refused(tmp_path, "fifo.txt", lambda p: os.mkfifo(p))
    assert "not a regular file" in str(err)


def test_a_pipe_a_pattern_matches_is_refused_not_passed_over(tmp_path):
    os.mkfifo(tmp_path / "fifo.jsonl")
    err = _refused(_config(tmp_path, {"train_files": ["*.jsonl"]}))
    assert "fifo.jsonl is not a regular file" in str(err)


def _finishes(fn, seconds: float = 10):
    """fn()'s result or exception, or a failure when it blocks past `seconds` (a read of a FIFO
    waits for a writer forever: the thread is left blocked, a daemon)."""
    done: list = []

    def run():
        try:
            done.append(("value", fn()))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            done.append(("error", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert done, f"blocked for more than {seconds} s"
    return done[0]


def test_a_chat_template_that_is_a_pipe_is_refused_without_reading_it(tmp_path):
    os.mkfifo(tmp_path / "template.jinja")
    config = _config(tmp_path, _chat_data(tmp_path, [_turns(("user", "hello"), ("assistant", "yes"))],
                                          chat_template="template.jinja"))
    kind, err = _finishes(lambda: chat_template.yaml_template(config))
    assert kind == "error" and isinstance(err, UserError), err
    assert err.problems[0].where == "data.chat_template" and "is not a regular file" in str(err)


@pytest.mark.parametrize(("content", "says"), [(b"x" * (chat_template.FILE_BYTES + 1), "a chat template is a few KiB"),
                                               (b"{{ 'caf\xe9' }}", "is not UTF-8: byte")])
def test_a_chat_template_file_too_large_or_not_utf8_is_refused(tmp_path, content, says):
    (tmp_path / "template.jinja").write_bytes(content)
    config = _config(tmp_path, {"train_files": ["chat.jsonl"], "chat_template": "template.jinja"})
    with pytest.raises(UserError, match="chat template file cannot be read") as info:
        chat_template.yaml_template(config)
    assert says in str(info.value)


# --- labels ------------------------------------------------------------------------------------------


def test_an_empty_label_in_a_classification_csv_is_refused_with_the_row(tmp_path):
    (tmp_path / "d.csv").write_text("text,label\nhello there,pos\nbad thing,\nok fine,neg\n")
    config = config_from_dict({
        "model": {"task": "sequence-classification", "architecture": {
            "model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "intermediate_size": 64, "vocab_size": 260, "max_position_embeddings": 64}},
        "train": {"seq_len": 32, "global_batch_size": 2},
        "data": {"num_proc": 1, "validation_ratio": 0.0, "train_files": ["d.csv"]}}, tmp_path)
    err = _refused(config)
    assert "record(s) 2 " in str(err)


def test_prepare_of_a_template_past_a_limit_exits_2_without_a_traceback(tmp_path):
    rows = [_turns(("user", "hello"), ("assistant", "yes"))]
    data = _chat_data(tmp_path, rows, chat_template="{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
    config = {"model": {"architecture": {**TINY_GPT2, "vocab_size": 64, "n_positions": 128}},
              "train": {"seq_len": 32, "global_batch_size": 2, "output_dir": str(tmp_path / "runs")},
              "data": {"num_proc": 1, **data}}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(cli, ["prepare", str(tmp_path / "model.yaml")])
    assert result.exit_code == 2, result.output
    assert "nests calls deeper" in result.output and "Traceback" not in result.output


def test_a_cut_conversation_keeps_its_configured_columns_and_roles(tmp_path):
    seq_len = 16
    long = "hello " * (3 * record_chars(seq_len))
    rows = [{"dialog": [{"speaker": "human", "text": "yes"}, {"speaker": "bot", "text": long}]}]
    data = _chat_data(tmp_path, rows, truncation="truncate", roles={"human": "user", "bot": "assistant"},
                      columns={"messages": "dialog", "role": "speaker", "content": "text"})
    prepared = prepare_data(_config(tmp_path, data, seq_len=seq_len))
    assert prepared.train.meta["records_cut"] == 1


def test_a_lone_surrogate_anywhere_in_a_record_is_found_before_a_tokenizer_sees_it():
    """Python's json reads an unpaired \\ud800 escape as a lone surrogate, which no tokenizer encodes
    (a TypeError inside it): the record's problem instead (sft_prepare.py `_tokens`, GRPO's prompts)."""
    from orchestrate.data.records import lone_surrogate

    assert lone_surrogate({"messages": [{"content": "fine é 🙂"}, {"content": ["x", "a\udce9"]}]}) == "U+DCE9"
    assert lone_surrogate({"prompt": "fine é 🙂", "n": 3, "x": None}) is None
