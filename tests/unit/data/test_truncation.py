"""Samples longer than seq_len keep their answer by default (`data.truncation: keep_answer`): the prompt
is cut from the left, so a long Alpaca sample keeps its whole answer and EOS with the labels it has
uncut, a leading BOS stays, a long chat keeps its last answers whole (an answer is never cut in part),
a sample whose answer alone does not fit is dropped and counted, positions restart at 0 at the kept
tokens, the record budget keeps a huge record's end, the cache entry follows the side a policy cuts
from, the old name `truncate` still means keep_start, and `orchestrate prepare` prints the counts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from orchestrate.cli import cli
from orchestrate.config.load import config_from_dict
from orchestrate.data.blocks import IGNORE_INDEX
from orchestrate.data.chat_templates import CHATML
from orchestrate.data.pipeline import describe_prepared, prepare_data, samples_for
from orchestrate.data.records import ALPACA_PROMPT_NO_INPUT, record_chars
from orchestrate.data.tokenizer import BYTE_EOS
from orchestrate.errors import UserError
from tests.helpers.chat_tokenizers import word_chat_tokenizer
from tests.helpers.plans import TINY_GPT2

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "be", "brief", "hello", "there", "paris", "yes", "no", "say", "hi", "bonjour"]
INSTRUCTION = "Name the capital of France and say one thing about it, " + "in plain words " * 12
ANSWER = "Paris, on the Seine."
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
                {"role": "assistant", "content": "paris"}, {"role": "user", "content": "say hi"},
                {"role": "assistant", "content": "bonjour"}]
"""23 ChatML tokens with the word tokenizer, "paris <|im_end|>" at 12-13 and "bonjour <|im_end|>" at 21-22."""


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _data(tmp_path: Path, seq_len: int, data: dict, packing: bool = False):
    arch = {**TINY_GPT2, "vocab_size": 300, "n_positions": 512}
    return config_from_dict({"model": {"architecture": arch}, "train": {"seq_len": seq_len, "global_batch_size": 2},
                             "data": {"num_proc": 1, "packing": packing, "validation_ratio": 0.0, **data}}, tmp_path)


def _train(config):
    prepared = prepare_data(config)
    return prepared, samples_for(prepared, config)[0]


def _alpaca(tmp_path: Path) -> dict:
    _jsonl(tmp_path / "alpaca.jsonl", [{"instruction": INSTRUCTION, "input": "", "output": ANSWER},
                                       {"instruction": "Say hi.", "input": "", "output": "hi"}])
    return {"train_files": ["alpaca.jsonl"]}


def _chat(tmp_path: Path, rows: list[dict], bos: str | None = None) -> dict:
    specials = [*CHATML_SPECIALS, *([bos] if bos else [])]
    word_chat_tokenizer(tmp_path / "tok", WORDS, specials, eos="<|im_end|>", bos=bos, template=CHATML.source)
    _jsonl(tmp_path / "chats.jsonl", rows)
    return {"train_files": ["chats.jsonl"], "tokenizer": "tok"}


def _trained(labels) -> list[int]:
    return [int(x) for x in labels if x != IGNORE_INDEX]


def _tokens(tmp_path: Path, ids: list[int]) -> list[str]:
    from transformers import AutoTokenizer  # a slow library

    return AutoTokenizer.from_pretrained(tmp_path / "tok").convert_ids_to_tokens(ids)


def _row(view, k: int) -> tuple[list[int], list[int]]:
    batch = view.batch([k])
    n = int(batch["attention_mask"][0].sum())
    return batch["input_ids"][0, :n].tolist(), batch["labels"][0, :n].tolist()


# --- keep_answer, the default ----------------------------------------------------------------------


def _uncut_alpaca(tmp_path: Path) -> tuple[list[int], list[int]]:
    """(ids, labels) of the long Alpaca sample at a seq_len that holds it whole."""
    (tmp_path / "whole").mkdir()
    _, whole = _train(_data(tmp_path / "whole", 512, _alpaca(tmp_path / "whole")))
    return _row(whole, 0)


def test_a_long_alpaca_sample_keeps_its_whole_answer_and_eos_with_the_labels_it_has_uncut(tmp_path):
    whole_ids, whole_labels = _uncut_alpaca(tmp_path)
    answer = [*ANSWER.encode(), BYTE_EOS]
    assert len(whole_ids) == len(ALPACA_PROMPT_NO_INPUT.format(instruction=INSTRUCTION)) + len(answer) > 256
    assert _trained(whole_labels) == answer

    config = _data(tmp_path, 256, _alpaca(tmp_path))
    assert config.data.truncation == "keep_answer"
    _, train = _train(config)
    ids, labels = _row(train, 0)
    assert ids == whole_ids[-256:]                        # the prompt's beginning is what went
    assert ids[-len(answer):] == answer and _trained(labels) == _trained(whole_labels)
    assert (train.kept.truncated, train.kept.dropped) == (1, 0)


def test_keep_start_cuts_the_same_sample_at_its_end_losing_its_eos(tmp_path):
    whole_ids, whole_labels = _uncut_alpaca(tmp_path)
    seq_len = len(whole_ids) - 3
    _, train = _train(_data(tmp_path, seq_len, {**_alpaca(tmp_path), "truncation": "keep_start"}))
    ids, labels = _row(train, 0)
    assert ids == whole_ids[:seq_len] and _trained(labels) == _trained(whole_labels)[:-3]  # "e.", then EOS, lost
    assert (train.kept.truncated, train.kept.dropped) == (1, 0)


def test_a_cut_sample_keeps_its_leading_bos(tmp_path):
    word_chat_tokenizer(tmp_path / "tok", WORDS, ["<s>", "</s>"], eos="</s>", bos="<s>")
    _jsonl(tmp_path / "pc.jsonl", [{"prompt": "hello there " * 10, "completion": "paris"}])
    config = _data(tmp_path, 8, {"train_files": ["pc.jsonl"], "tokenizer": "tok"})
    prepared, train = _train(config)
    assert prepared.train.meta["bos_id"] == 0
    ids, labels = _row(train, 0)
    hello, there, paris = (3 + WORDS.index(w) for w in ("hello", "there", "paris"))  # after <s>, </s>, [UNK]
    assert ids == [0, there, *[hello, there] * 2, paris, 1]  # <s>, the prompt's last 5 words, the answer, </s>
    assert _trained(labels) == [paris, 1]


def test_a_long_chat_keeps_its_last_answers_whole(tmp_path):
    data = _chat(tmp_path, [{"messages": CONVERSATION}])
    for seq_len, kept, trained in [
        (23, 23, ["paris", "<|im_end|>", "bonjour", "<|im_end|>"]),  # fits
        (12, 12, ["paris", "<|im_end|>", "bonjour", "<|im_end|>"]),  # the system turn and the first question go
        (11, 9, ["bonjour", "<|im_end|>"]),   # "paris" would come first, unpredicted: the cut moves past its answer
        (10, 9, ["bonjour", "<|im_end|>"]),   # the cut falls inside the first answer: it moves past it
    ]:
        _, train = _train(_data(tmp_path, seq_len, data))
        ids, labels = _row(train, 0)
        assert len(ids) == kept and _tokens(tmp_path, _trained(labels)) == trained, seq_len
        assert _tokens(tmp_path, ids[-2:]) == ["bonjour", "<|im_end|>"]


def test_keep_start_drops_the_chat_whose_first_seq_len_tokens_hold_no_answer(tmp_path):
    _, train = _train(_data(tmp_path, 10, {**_chat(tmp_path, [{"messages": CONVERSATION}] * 2),
                                           "truncation": "keep_start"}))
    assert (train.samples, train.kept.dropped) == (0, 2)


def test_a_sample_whose_answer_does_not_fit_is_dropped_and_counted(tmp_path):
    rows = [{"messages": CONVERSATION}, {"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "yes " * 20}]}]
    config = _data(tmp_path, 12, _chat(tmp_path, rows))
    prepared, train = _train(config)
    assert (train.samples, train.kept.truncated, train.kept.dropped) == (1, 1, 1)
    summary = describe_prepared(prepared, config)
    assert ("samples: 1 had their prompt cut from the left to fit seq_len 12 (keep_answer); "
            "1 dropped: an answer that does not fit in seq_len 12") in summary


def test_packed_cut_samples_start_their_positions_at_0(tmp_path):
    config = _data(tmp_path, 12, _chat(tmp_path, [{"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]}]),
                   packing=True)
    _, train = _train(config)
    lengths = sorted(train.kept.lengths.tolist())
    assert lengths == [9, 12]  # the short chat whole (9 tokens), the long one cut to 12
    for block in range(len(train)):
        batch = train.batch([block])
        members = [int(train.kept.lengths[k]) for k in train.blocks.of(block).tolist()]
        expected = np.concatenate([np.arange(n) for n in members])
        assert batch["position_ids"][0, : len(expected)].tolist() == expected.tolist()


def test_truncation_error_names_the_sample_and_the_policies(tmp_path):
    config = _data(tmp_path, 12, {**_chat(tmp_path, [{"messages": CONVERSATION[1:3]}, {"messages": CONVERSATION}]),
                                  "truncation": "error"})
    with pytest.raises(UserError) as info:
        _train(config)
    problem, = info.value.problems
    assert problem.where == "data.truncation" and "sample 1 " in problem.message and "keep_answer" in problem.fix


def test_truncate_is_the_old_name_of_keep_start(tmp_path):
    assert _data(tmp_path, 64, {"truncation": "truncate"}).data.truncation == "keep_start"


# --- the record budget and the cache ------------------------------------------------------------------


def test_a_huge_prompt_is_cut_from_the_left_before_tokenising_and_the_answer_kept(tmp_path):
    seq_len = 16
    rows = [{"prompt": "x" * (3 * record_chars(seq_len)), "completion": "the answer"}]
    _jsonl(tmp_path / "pc.jsonl", rows)
    prepared, train = _train(_data(tmp_path, seq_len, {"train_files": ["pc.jsonl"]}))
    assert prepared.train.meta["records_cut"] == 1 and train.kept.truncated == 1
    ids, labels = _row(train, 0)
    assert ids == [*b"x" * 5, *b"the answer", BYTE_EOS] and _trained(labels) == [*b"the answer", BYTE_EOS]


def test_a_long_conversation_is_split_only_as_far_back_as_seq_len_reaches(tmp_path):
    turns = [m for _ in range(3000) for m in ({"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"})]
    data = _chat(tmp_path, [{"messages": turns}])
    start = time.perf_counter()
    prepared, train = _train(_data(tmp_path, 32, {**data, "roles_to_train": ["user", "assistant"]}))
    assert time.perf_counter() - start < 20
    assert prepared.train.meta["records_cut"] == 1  # its earliest turns left out before tokenising
    ids, labels = _row(train, 0)
    assert len(labels) == 32 and len(_trained(labels)) > 10
    assert _tokens(tmp_path, ids[-2:]) == ["yes", "<|im_end|>"]


def test_the_cache_entry_follows_the_side_the_policy_cuts_from(tmp_path):
    data = _alpaca(tmp_path)
    entry = {policy: prepare_data(_data(tmp_path, 64, {**data, "truncation": policy})).train.directory
             for policy in ("keep_answer", "keep_start", "drop", "error")}
    assert entry["keep_answer"] != entry["keep_start"]  # a record past the budget keeps its end, or its start
    assert entry["keep_start"] == entry["drop"] == entry["error"]  # the rest of the policy is a view


# --- orchestrate prepare ---------------------------------------------------------------------------------


def test_prepare_prints_how_many_samples_had_their_prompt_cut_and_were_dropped(tmp_path):
    data = _chat(tmp_path, [{"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]},
                            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes " * 20}]}])
    config = {"model": {"architecture": {**TINY_GPT2, "vocab_size": 64, "n_positions": 128}},
              "train": {"seq_len": 12, "global_batch_size": 2, "output_dir": str(tmp_path / "runs")},
              "data": {"num_proc": 1, "validation_ratio": 0.0, **data}}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(cli, ["prepare", str(tmp_path / "model.yaml")])
    assert result.exit_code == 0, result.output
    assert "1 had their prompt cut from the left to fit seq_len 12 (keep_answer)" in result.output
    assert "1 dropped: an answer that does not fit in seq_len 12" in result.output
