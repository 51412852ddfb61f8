"""`data.last_turn_only`: a multi-turn chat carries the loss on its last trained turn only (the final
answer and its end-of-turn token), checked token by token against labels written down here, for a
template with generation markers and the same template without them (turn-by-turn rendering), with
other roles trained and with a conversation that ends on a user turn; evaluation still reads every
answer; the option enters the data cache key (and leaves the keys made without it as they were); a
long chat keeps its last answer under keep_answer truncation and is dropped under keep_start, which
cuts that answer away; with train_on_inputs it is one error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from orchestrate.config.load import config_from_dict
from orchestrate.data.chat_templates import CHATML
from orchestrate.data.method_data import NO_METHOD_DATA
from orchestrate.data.pipeline import prepare_data
from orchestrate.data.sft_prepare import SftSettings
from orchestrate.data.sft_tokens import LAST_TURN, MARKERS
from orchestrate.errors import UserError
from tests.helpers.chat_tokenizers import word_chat_tokenizer
from tests.helpers.plans import TINY_GPT2
from tests.helpers.sample_rows import sample_rows

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "be", "brief", "hello", "there", "paris", "say", "hi", "bonjour", "thanks"]
UNMARKED = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", CHATML.source)
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "paris"}, {"role": "user", "content": "say hi"},
        {"role": "assistant", "content": "bonjour"}]
TOKENS = ["<|im_start|>", "system", "be", "brief", "<|im_end|>",
          "<|im_start|>", "user", "hello", "there", "<|im_end|>",
          "<|im_start|>", "assistant", "paris", "<|im_end|>",
          "<|im_start|>", "user", "say", "hi", "<|im_end|>",
          "<|im_start|>", "assistant", "bonjour", "<|im_end|>"]


def _config(tmp_path: Path, data: dict, seq_len: int = 64):
    arch = {**TINY_GPT2, "vocab_size": 64, "n_positions": 128}
    return config_from_dict({"model": {"architecture": arch}, "train": {"seq_len": seq_len, "global_batch_size": 2},
                             "data": {"num_proc": 1, "packing": False, "validation_ratio": 0.0, "tokenizer": "tok",
                                      "train_files": ["chats.jsonl"], **data}}, tmp_path)


def _write(tmp_path: Path, conversations: list[list[dict]], template: str = CHATML.source) -> None:
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    word_chat_tokenizer(tmp_path / "tok", WORDS, SPECIALS, eos="<|im_end|>", template=template)


def _rows(tmp_path: Path, data: dict, seq_len: int = 64, validation: bool = False) -> list[tuple[list, list]]:
    """Every training (or validation) sample as (tokens, labels): a label is the token it trains on
    (evaluates, for validation), None where -100."""
    return sample_rows(_config(tmp_path, data, seq_len), tmp_path, validation)


@pytest.mark.parametrize("template", [CHATML.source, UNMARKED], ids=["markers", "turn-by-turn"])
def test_only_the_final_answer_and_its_end_token_carry_the_loss(tmp_path, template):
    _write(tmp_path, [CHAT], template)
    (tokens, labels), = _rows(tmp_path, {"last_turn_only": True})
    assert tokens == TOKENS
    assert labels == [None] * 21 + ["bonjour", "<|im_end|>"]
    (_, every_answer), = _rows(tmp_path, {})
    assert every_answer == [None] * 12 + ["paris", "<|im_end|>"] + [None] * 7 + ["bonjour", "<|im_end|>"]


def test_the_last_turn_of_the_trained_roles_whatever_its_role(tmp_path):
    ends_on_user = [*CHAT, {"role": "user", "content": "thanks"}]
    _write(tmp_path, [ends_on_user])
    (_, answers), = _rows(tmp_path, {"last_turn_only": True})
    assert answers == [None] * 21 + ["bonjour", "<|im_end|>"] + [None] * 4  # the last assistant turn
    (_, users), = _rows(tmp_path, {"last_turn_only": True, "roles_to_train": ["user", "assistant"]})
    # the closing user turn, its header too (a turn other than an answer has no generation prompt to split at)
    assert users == [None] * 23 + ["<|im_start|>", "user", "thanks", "<|im_end|>"]


def test_evaluation_still_reads_every_answer(tmp_path):
    _write(tmp_path, [CHAT])
    (_, labels), = _rows(tmp_path, {"last_turn_only": True, "validation_files": ["chats.jsonl"]}, validation=True)
    assert labels == [None] * 12 + ["paris", "<|im_end|>"] + [None] * 7 + ["bonjour", "<|im_end|>"]


def test_it_enters_the_cache_key_and_leaves_the_other_keys_as_they_were(tmp_path):
    _write(tmp_path, [CHAT])
    off, on = _config(tmp_path, {}), _config(tmp_path, {"last_turn_only": True})
    unset = SftSettings.of(off, NO_METHOD_DATA).identity()
    assert "last_turn_only" not in unset
    assert SftSettings.of(on, NO_METHOD_DATA).identity() == {**unset, "last_turn_only": True}
    first, second = prepare_data(off).train, prepare_data(on).train
    assert first.directory != second.directory
    assert second.meta["mask_method"] == MARKERS + LAST_TURN


def test_a_long_chat_keeps_its_last_answer_unless_truncation_keeps_the_start(tmp_path):
    short = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "paris"}]
    _write(tmp_path, [CHAT, short])
    # keep_answer (the default): CHAT loses its earliest turns and keeps "bonjour", the only trained answer
    kept = _rows(tmp_path, {"last_turn_only": True}, seq_len=16)
    assert sorted([t for t in labels if t] for _, labels in kept) == [["bonjour", "<|im_end|>"], ["paris", "<|im_end|>"]]
    # keep_start: CHAT's last answer starts at token 21, past seq_len; the sample trains nothing, dropped
    rows = _rows(tmp_path, {"last_turn_only": True, "truncation": "keep_start"}, seq_len=16)
    assert [labels for _, labels in rows] == [[None] * 6 + ["paris", "<|im_end|>"]]


def test_with_train_on_inputs_it_is_one_error(tmp_path):
    with pytest.raises(UserError) as refused:
        _config(tmp_path, {"last_turn_only": True, "train_on_inputs": True})
    (problem,) = refused.value.problems
    assert problem.where == "data.last_turn_only" and "train_on_inputs: false" in problem.fix
