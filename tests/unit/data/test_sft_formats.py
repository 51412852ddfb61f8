"""Chat and instruction records become the right samples: each format is detected from its columns (or
named), its tokens and labels are checked one by one against what is written down here, ShareGPT's
columns and roles map onto the chat ones, the loss covers the answers (or the roles asked for, or
everything), long samples follow the truncation policy, and every bad input is one error with the
YAML path and a fix. Also what data.template accepts (plain {column} fields only) and that
validation_ratio 0 holds nothing out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from orchestrate.config.load import config_from_dict
from orchestrate.data.chat_templates import CHATML
from orchestrate.data.pipeline import check_data_config, prepare_data, samples_for
from orchestrate.data.records import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, detect_format
from orchestrate.errors import UserError
from tests.helpers.chat_tokenizers import word_chat_tokenizer
from tests.helpers.plans import TINY_GPT2
from tests.helpers.sample_rows import sample_rows

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "be", "brief", "hello", "there", "paris", "yes", "no", "capital", "of",
         "france", "say", "hi", "bonjour"]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path: Path, data: dict, seq_len: int = 64, vocab: int = 64):
    arch = {**TINY_GPT2, "vocab_size": vocab, "n_positions": 128}
    return config_from_dict({"model": {"architecture": arch}, "train": {"seq_len": seq_len, "global_batch_size": 2},
                             "data": {"num_proc": 1, "packing": False, "validation_ratio": 0.0, **data}}, tmp_path)


def _chat_tokenizer(tmp_path: Path, template: str | None = CHATML.source) -> str:
    word_chat_tokenizer(tmp_path / "tok", WORDS, CHATML_SPECIALS, eos="<|im_end|>", template=template)
    return "tok"


def _rows(tmp_path: Path, data: dict, **kw) -> list[tuple[list[str], list[str | None]]]:
    """Every training sample as (tokens, labels): a label is the token it trains on, None where -100."""
    return sample_rows(_config(tmp_path, data, **kw), tmp_path)


# --- detection ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("columns", "data", "expected"), [
    (["messages"], {}, "chat"),
    (["conversations", "id"], {}, "chat"),                                   # ShareGPT
    (["dialog"], {"columns": {"messages": "dialog"}}, "chat"),
    (["prompt", "completion"], {}, "prompt-completion"),
    (["instruction", "input", "output"], {}, "alpaca"),
    (["instruction", "output"], {}, "alpaca"),                               # input is optional
    (["text"], {}, "text"),
    (["prompt", "response"], {}, "text"),                                    # no completion column: plain text
    (["messages"], {"template": "{messages}"}, "text"),                      # a template means text
    (["prompt", "completion"], {"record_format": "text"}, "text"),           # the override wins
])
def test_the_record_format_is_detected_from_the_columns(tmp_path, columns, data, expected):
    assert detect_format(columns, _config(tmp_path, data).data) == expected


# --- tokens and labels, one by one ----------------------------------------------------------------


def test_chat_labels_train_the_answers_and_their_end_of_turn_token(tmp_path):
    _jsonl(tmp_path / "chats.jsonl", [{"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "paris"}, {"role": "user", "content": "say hi"},
        {"role": "assistant", "content": "bonjour"}]}])
    (tokens, labels), = _rows(tmp_path, {"train_files": ["chats.jsonl"], "tokenizer": _chat_tokenizer(tmp_path)})
    assert tokens == ["<|im_start|>", "system", "be", "brief", "<|im_end|>",
                      "<|im_start|>", "user", "hello", "there", "<|im_end|>",
                      "<|im_start|>", "assistant", "paris", "<|im_end|>",
                      "<|im_start|>", "user", "say", "hi", "<|im_end|>",
                      "<|im_start|>", "assistant", "bonjour", "<|im_end|>"]
    assert labels == [None] * 12 + ["paris", "<|im_end|>"] + [None] * 7 + ["bonjour", "<|im_end|>"]


def test_sharegpt_columns_and_roles_give_the_same_sample(tmp_path):
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "paris"}]
    sharegpt = [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "paris"}]
    _jsonl(tmp_path / "openai.jsonl", [{"messages": messages}])
    _jsonl(tmp_path / "sharegpt.jsonl", [{"conversations": sharegpt}])
    _jsonl(tmp_path / "mapped.jsonl", [{"dialog": [{"speaker": "bot", "text": m["content"]} if m["role"] == "assistant"
                                                   else {"speaker": "human", "text": m["content"]} for m in messages]}])
    tok = _chat_tokenizer(tmp_path)
    openai = _rows(tmp_path, {"train_files": ["openai.jsonl"], "tokenizer": tok})
    assert _rows(tmp_path, {"train_files": ["sharegpt.jsonl"], "tokenizer": tok}) == openai
    mapped = {"train_files": ["mapped.jsonl"], "tokenizer": tok, "roles": {"human": "user", "bot": "assistant"},
              "columns": {"messages": "dialog", "role": "speaker", "content": "text"}}
    assert _rows(tmp_path, mapped) == openai
    assert openai[0][1] == [None] * 7 + ["paris", "<|im_end|>"]


def test_roles_to_train_and_train_on_inputs(tmp_path):
    _jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "hello there"},
                                                    {"role": "assistant", "content": "paris"}]}])
    base = {"train_files": ["chats.jsonl"], "tokenizer": _chat_tokenizer(tmp_path)}
    (tokens, users), = _rows(tmp_path, {**base, "roles_to_train": ["user", "assistant"]})
    # the user's whole turn (its header too: a turn has no generation prompt to split at), then the answer
    assert users == [None, "user", "hello", "there", "<|im_end|>", None, None, "paris", "<|im_end|>"]
    (_, everything), = _rows(tmp_path, {**base, "train_on_inputs": True})
    assert everything == [None, *tokens[1:]]  # every token but the first, which nothing precedes


def test_prompt_completion_keeps_the_tokenizers_bos_and_adds_one_eos(tmp_path):
    _jsonl(tmp_path / "pc.jsonl", [{"prompt": "capital of france", "completion": "paris"}])
    word_chat_tokenizer(tmp_path / "tok", WORDS, ["<s>", "</s>"], eos="</s>", bos="<s>")
    (tokens, labels), = _rows(tmp_path, {"train_files": ["pc.jsonl"], "tokenizer": "tok"})
    assert tokens == ["<s>", "capital", "of", "france", "paris", "</s>"]
    assert labels == [None, None, None, None, "paris", "</s>"]


def test_a_completion_that_ends_with_eos_gets_no_second_one(tmp_path):
    _jsonl(tmp_path / "pc.jsonl", [{"prompt": "capital of france", "completion": "paris</s>"}])
    word_chat_tokenizer(tmp_path / "tok", WORDS, ["<s>", "</s>"], eos="</s>", bos="<s>")
    (tokens, _), = _rows(tmp_path, {"train_files": ["pc.jsonl"], "tokenizer": "tok"})
    assert tokens == ["<s>", "capital", "of", "france", "paris", "</s>"]


def test_alpaca_prompts_with_and_without_input(tmp_path):
    _jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Say hi", "input": "", "output": "Hi"},
                                       {"instruction": "Say hi", "input": "to Ann", "output": "Hi Ann"}])
    rows = _rows(tmp_path, {"train_files": ["alpaca.jsonl"]}, seq_len=512, vocab=257)
    no_input, with_input = ALPACA_PROMPT_NO_INPUT.format(instruction="Say hi"), \
        ALPACA_PROMPT.format(instruction="Say hi", input="to Ann")
    assert no_input.endswith("### Instruction:\nSay hi\n\n### Response:\n")  # no empty Input section, no stray line
    for (tokens, labels), prompt, answer in zip(rows, (no_input, with_input), ("Hi", "Hi Ann"), strict=True):
        assert "".join(tokens) == prompt + answer + "EOS"  # byte tokenizer: one token per byte, then EOS
        assert labels == [None] * len(prompt) + [*answer, "EOS"]


def test_chat_template_in_the_yaml_turns_prompt_completion_into_a_chat(tmp_path):
    _jsonl(tmp_path / "pc.jsonl", [{"prompt": "capital of france", "completion": "paris"}])
    tok = _chat_tokenizer(tmp_path, template=None)
    (tokens, labels), = _rows(tmp_path, {"train_files": ["pc.jsonl"], "tokenizer": tok, "chat_template": "chatml"})
    assert tokens == ["<|im_start|>", "user", "capital", "of", "france", "<|im_end|>",
                      "<|im_start|>", "assistant", "paris", "<|im_end|>"]
    assert labels == [None] * 8 + ["paris", "<|im_end|>"]


def test_plain_text_still_packs_one_stream_with_every_token_trained(tmp_path):
    (tmp_path / "docs.txt").write_text("ab\n\ncd\n")
    config = _config(tmp_path, {"train_files": ["docs.txt"], "packing": True}, seq_len=3, vocab=257)
    train, _ = samples_for(prepare_data(config), config)
    batch = train.batch([0, 1])
    assert batch["input_ids"].tolist() == [[97, 98, 256], [99, 100, 256]] == batch["labels"].tolist()
    assert "position_ids" not in batch


# --- long samples ---------------------------------------------------------------------------------


def _long_chats(tmp_path: Path) -> dict:
    _jsonl(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]},           # 8 tokens
        {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "paris"}]},  # 9
        {"messages": [{"role": "user", "content": " ".join(["hello"] * 8)}, {"role": "assistant", "content": "no"}]}])
    return {"train_files": ["chats.jsonl"], "tokenizer": _chat_tokenizer(tmp_path)}


@pytest.mark.parametrize(("policy", "kept", "truncated", "dropped"), [
    ("truncate", [8, 8], 1, 1),   # 9 -> 8 keeps "paris"; the third keeps only its prompt: dropped, counted
    ("drop", [8], 0, 2),
])
def test_samples_longer_than_seq_len_follow_the_truncation_policy(tmp_path, policy, kept, truncated, dropped):
    config = _config(tmp_path, {**_long_chats(tmp_path), "truncation": policy}, seq_len=8)
    train, _ = samples_for(prepare_data(config), config)
    assert sorted(train.kept.lengths.tolist()) == kept
    assert (train.kept.truncated, train.kept.dropped) == (truncated, dropped)


def test_truncation_error_names_the_sample_and_the_fix(tmp_path):
    config = _config(tmp_path, {**_long_chats(tmp_path), "truncation": "error"}, seq_len=8)
    with pytest.raises(UserError) as err:
        samples_for(prepare_data(config), config)
    problem, = err.value.problems
    assert problem.where == "data.truncation" and "sample 1" in problem.message and "seq_len" in problem.fix


# --- bad input: one error, the YAML path, a fix ----------------------------------------------------


def _refused(tmp_path: Path, rows: list[dict], data: dict):
    _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(UserError) as err:
        prepare_data(_config(tmp_path, {"train_files": ["bad.jsonl"], **data}))
    assert len(err.value.problems) == 1 and err.value.problems[0].fix
    return err.value.problems[0]


def test_a_template_over_a_list_column_is_refused(tmp_path):
    p = _refused(tmp_path, [{"messages": [{"role": "user", "content": "hi"}]}], {"template": "{messages}"})
    assert p.where == "data.template" and "messages" in p.message and "chat" in p.fix


def test_a_text_field_over_a_list_column_points_at_chat_records(tmp_path):
    p = _refused(tmp_path, [{"text": ["a", "b"]}], {})
    assert p.where == "data.text_field" and "chat" in p.fix


def test_a_conversation_without_an_assistant_turn_is_refused(tmp_path):
    p = _refused(tmp_path, [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]},
                            {"messages": [{"role": "user", "content": "hello"}]}], {"tokenizer": _chat_tokenizer(tmp_path)})
    assert p.where == "data.train_files[0]" and "record 1" in p.message and "assistant turn" in p.message


def test_an_unknown_role_is_refused_with_the_mapping_that_fixes_it(tmp_path):
    p = _refused(tmp_path, [{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yes"}]}],
                 {"tokenizer": _chat_tokenizer(tmp_path)})
    assert "record 0" in p.message and "'bot'" in p.message and "data.roles: {bot: assistant}" in p.message


def test_a_template_that_renders_nothing_trainable_is_refused(tmp_path):
    silent = "{% for m in messages %}{{ m.role }}{% endfor %}"  # never renders the content
    p = _refused(tmp_path, [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}],
                 {"tokenizer": _chat_tokenizer(tmp_path), "chat_template": silent})
    assert p.where == "data.chat_template" and "content is not rendered" in p.message and "message.content" in p.fix


def test_roles_with_no_turn_in_any_record_leave_nothing_trainable(tmp_path):
    p = _refused(tmp_path, [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}],
                 {"tokenizer": _chat_tokenizer(tmp_path), "roles_to_train": ["tool"]})
    assert "record 0" in p.message and "no tool turn" in p.message


def test_a_tokenizer_without_a_template_and_none_in_the_yaml_is_refused(tmp_path):
    p = _refused(tmp_path, [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}],
                 {"tokenizer": _chat_tokenizer(tmp_path, template=None)})
    assert p.where == "data.tokenizer" and "no chat_template" in p.message and "chatml" in p.fix


def test_bad_chat_records_are_one_message_from_the_cli(tmp_path):
    import yaml

    from tests.helpers.cli import assert_one_message, invoke

    _jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yes"}]}])
    (tmp_path / "model.yaml").write_text(yaml.safe_dump({
        "model": {"architecture": {**TINY_GPT2, "vocab_size": 64, "n_positions": 128}},
        "train": {"seq_len": 64, "global_batch_size": 2},
        "data": {"train_files": ["bad.jsonl"], "tokenizer": _chat_tokenizer(tmp_path), "num_proc": 1,
                 "cache_dir": str(tmp_path / "cache")}}))
    assert_one_message(invoke("prepare", tmp_path / "model.yaml"), "data.train_files[0]", "'bot'",
                       "data.roles: {bot: assistant}")


def test_an_unknown_template_name_is_refused_before_any_data_is_read(tmp_path):
    config = _config(tmp_path, {"train_files": ["absent.jsonl"], "chat_template": "chatlm"})
    with pytest.raises(UserError) as err:
        check_data_config(config, 128, 64)
    assert any(p.where == "data.chat_template" and "chatml" in p.fix for p in err.value.problems)


# --- data.template and validation_ratio (plain fields only; 0 holds nothing out) --------------------


@pytest.mark.parametrize(("template", "why"), [
    ("{text:>999999999}", "format spec"),       # would pad every record to a gigabyte
    ("{text[100000]}", "indexes"),               # was an IndexError traceback
    ("{text.__class__.__mro__}", "attribute"),   # trained on Python's type reprs
    ("{text!r}", "converts"),
    ("{}", "positional"),
])
def test_data_templates_take_plain_column_fields_only(tmp_path, template, why):
    _jsonl(tmp_path / "docs.jsonl", [{"text": "hello"}])
    config = _config(tmp_path, {"train_files": ["docs.jsonl"], "template": template}, vocab=257)
    with pytest.raises(UserError) as err:
        check_data_config(config, 128, 257)
    problem, = err.value.problems
    assert problem.where == "data.template" and why in problem.message and "{column}" in problem.fix


def test_a_plain_template_renders_its_columns(tmp_path):
    _jsonl(tmp_path / "docs.jsonl", [{"q": "ab", "a": None}])
    config = _config(tmp_path, {"train_files": ["docs.jsonl"], "template": "Q:{q} A:{a}|{{x}}"}, vocab=257)
    stream = prepare_data(config).train
    assert bytes(np.asarray(stream.tokens[:-1], dtype=np.uint8)).decode() == "Q:ab A:|{x}"  # null renders empty


def test_validation_ratio_zero_holds_out_nothing(tmp_path):
    (tmp_path / "docs.txt").write_text("".join(f"document number {i}\n\n" for i in range(20)))
    config = _config(tmp_path, {"train_files": ["docs.txt"], "packing": True, "validation_ratio": 0.0},
                     seq_len=16, vocab=257)
    train, validation = samples_for(prepare_data(config), config)
    assert len(validation) == 0 and len(train) == len(prepare_data(config).train.tokens) // 16
