"""Several datasets in one run (`data.datasets`): each source is read and detected on its own (files of
other columns side by side), chat, Alpaca and ShareGPT records become one stream of samples with the
right loss mask per source, the mix takes the records its weights or counts ask for (seeded, the same
every time), the prepare line says what each source gave, and what cannot share a stream (text or
preference records beside chat) is one error naming both files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from orchestrate.config.load import config_from_dict
from orchestrate.data.blocks import IGNORE_INDEX
from orchestrate.data.chat_templates import CHATML
from orchestrate.data.mixing import Mix
from orchestrate.data.pipeline import describe_prepared, prepare_data, samples_for
from orchestrate.data.records import ALPACA_PROMPT_NO_INPUT
from orchestrate.errors import UserError
from tests.helpers.chat_tokenizers import word_chat_tokenizer
from tests.helpers.plans import TINY_GPT2

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "be", "brief", "hello", "there", "paris", "capital", "of", "france",
         "say", "hi", "bonjour", "rome", "italy"]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chats(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "paris"}],
             "id": i} for i in range(n)]


def _alpaca(n: int) -> list[dict]:
    return [{"instruction": "say hi", "input": "", "output": "bonjour", "id": i} for i in range(n)]


def _sharegpt(n: int) -> list[dict]:
    return [{"conversations": [{"from": "human", "value": "capital of italy"}, {"from": "gpt", "value": "rome"}],
             "id": i} for i in range(n)]


def _config(tmp_path: Path, data: dict, seed: int = 0, seq_len: int = 64):
    arch = {**TINY_GPT2, "vocab_size": 64, "n_positions": 128}
    return config_from_dict({"model": {"architecture": arch}, "train": {"seq_len": seq_len, "global_batch_size": 2,
                                                                        "seed": seed},
                             "data": {"num_proc": 1, "packing": False, "validation_ratio": 0.0, **data}}, tmp_path)


def _tokenizer(tmp_path: Path) -> str:
    word_chat_tokenizer(tmp_path / "tok", WORDS, CHATML_SPECIALS, eos="<|im_end|>", template=CHATML.source)
    return "tok"


def _three_sources(tmp_path: Path) -> None:
    _jsonl(tmp_path / "chat.jsonl", _chats(60))
    _jsonl(tmp_path / "alpaca.jsonl", _alpaca(20))
    _jsonl(tmp_path / "sharegpt.jsonl", _sharegpt(40))


def _samples(tmp_path: Path, config) -> list[tuple[tuple[str, ...], list[str | None]]]:
    """Every training sample as (tokens, labels): a label is the token it trains on, None where -100."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    train, _ = samples_for(prepare_data(config), config)
    out = []
    for k in range(len(train)):
        batch = train.batch([k])
        n = int(batch["attention_mask"][0].sum())
        ids, labels = batch["input_ids"][0, :n].tolist(), batch["labels"][0, :n].tolist()
        out.append((tuple(tok.convert_ids_to_tokens(ids)), [None if x == IGNORE_INDEX else tok.convert_ids_to_tokens(x)
                                                            for x in labels]))
    return out


# --- how many records each source gives ------------------------------------------------------------


def _mix(weights=(None, None, None), samples=(None, None, None), stopping="first_exhausted", seed=0) -> Mix:
    return Mix(("a", "b", "c")[: len(weights)], tuple(weights), tuple(samples), stopping, seed)


@pytest.mark.parametrize(("weights", "samples", "stopping", "sizes", "expected"), [
    ((None, None, None), (None, None, None), "first_exhausted", [60, 20, 40], [60, 20, 40]),  # every record
    ((2.0, 1.0, 1.0), (None, None, None), "first_exhausted", [60, 20, 40], [40, 20, 20]),     # b runs out first
    ((2.0, 1.0, 1.0), (None, None, None), "all_exhausted", [60, 20, 40], [80, 40, 40]),       # a runs out last
    ((1.0, 3.0, None), (None, None, 10), "first_exhausted", [60, 20, 40], [7, 20, 10]),       # samples beside
    ((None, None, None), (100, 5, None), "first_exhausted", [60, 20, 40], [100, 5, 40]),
])
def test_weights_are_shares_of_the_mix_and_samples_exact_counts(weights, samples, stopping, sizes, expected):
    counts = _mix(weights, samples, stopping).counts(sizes)
    assert counts == expected
    shared = [i for i, w in enumerate(weights) if w is not None]
    for i in shared:  # each weighted source's share of the weighted part, to a record
        assert abs(counts[i] - sum(counts[j] for j in shared) * weights[i] / sum(weights[j] for j in shared)) <= 1


def test_a_count_past_the_source_repeats_every_record_as_evenly_as_it_can():
    rows = _mix(samples=(25, None, None)).chosen(0, 10, 25)
    assert len(rows) == 25 and sorted(set(rows.tolist())) == list(range(10))
    assert sorted(np.bincount(rows, minlength=10).tolist()) == [2] * 5 + [3] * 5


def test_the_records_taken_depend_on_the_seed_only():
    first = _mix(samples=(30, None, None), seed=1).chosen(0, 100, 30)
    assert (first == _mix(samples=(30, None, None), seed=1).chosen(0, 100, 30)).all()
    assert not np.array_equal(first, _mix(samples=(30, None, None), seed=2).chosen(0, 100, 30))
    assert len(set(first.tolist())) == 30 and (np.diff(first) > 0).all()  # without replacement, in file order
    assert _mix().chosen(0, 100, 100) is None  # every record once: nothing to choose


def test_an_entrys_rows_are_split_over_its_parts():
    """An entry read as two parts (files of other columns) takes its records across both."""
    mix = Mix(("a", "b"), (None, None), (8, None), "first_exhausted", 0)
    rows, sizes = mix.rows([0, 0, 1], [6, 4, 5])
    assert sizes == [10, 5] and rows[2] is None
    taken = np.concatenate([rows[0], rows[1] + 6])
    assert (taken == mix.chosen(0, 10, 8)).all() and rows[0].max() < 6 and rows[1].max() < 4


# --- one stream of three shapes -------------------------------------------------------------------


def test_chat_alpaca_and_sharegpt_sources_mix_by_weight_with_each_mask_right(tmp_path):
    _three_sources(tmp_path)
    config = _config(tmp_path, {"tokenizer": _tokenizer(tmp_path), "datasets": [
        {"path": "chat.jsonl", "weight": 2.0}, {"path": "alpaca.jsonl", "weight": 1.0},
        {"path": "sharegpt.jsonl", "weight": 1.0}]})
    prepared = prepare_data(config)
    assert [(e["source"], e["record_format"], e["records"], e["taken"]) for e in prepared.train.meta["mix"]] == [
        ("chat.jsonl", "chat", 60, 40), ("alpaca.jsonl", "alpaca", 20, 20), ("sharegpt.jsonl", "chat", 40, 20)]
    assert prepared.train.meta["record_format"] == "chat" and prepared.train.num_documents == 80
    samples = _samples(tmp_path, config)
    by_tokens: dict[tuple[str, ...], list] = {}
    for tokens, labels in samples:
        by_tokens.setdefault(tokens, []).append(labels)
    chat = ("<|im_start|>", "user", "hello", "there", "<|im_end|>", "<|im_start|>", "assistant", "paris", "<|im_end|>")
    alpaca = ("<|im_start|>", "user", "say", "hi", "<|im_end|>", "<|im_start|>", "assistant", "bonjour", "<|im_end|>")
    sharegpt = ("<|im_start|>", "user", "capital", "of", "italy", "<|im_end|>", "<|im_start|>", "assistant", "rome",
                "<|im_end|>")
    # the Alpaca records are one user and one assistant turn of the same template as the chats
    assert {k: len(v) for k, v in by_tokens.items()} == {chat: 40, alpaca: 20, sharegpt: 20}
    assert by_tokens[chat][0] == [None] * 7 + ["paris", "<|im_end|>"]
    assert by_tokens[alpaca][0] == [None] * 7 + ["bonjour", "<|im_end|>"]
    assert by_tokens[sharegpt][0] == [None] * 8 + ["rome", "<|im_end|>"]
    line = describe_prepared(prepared, config)
    assert ("mix: chat.jsonl: 40 of 60 chat records (weight 2.0); alpaca.jsonl: 20 of 20 alpaca records "
            "(weight 1.0); sharegpt.jsonl: 20 of 40 chat records (weight 1.0)") in line
    assert line.index("mix:") < line.index("cache:")


def test_instruction_records_without_a_chat_mix_raw_as_prompt_and_completion(tmp_path):
    _jsonl(tmp_path / "pc.jsonl", [{"prompt": "ab", "completion": "c"}] * 3)
    _jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Say hi", "output": "Hi"}] * 2)
    config = _config(tmp_path, {"datasets": [{"path": "pc.jsonl"}, {"path": "alpaca.jsonl"}]}, seq_len=512)
    prepared = prepare_data(config)
    assert prepared.train.meta["record_format"] == "prompt-completion"
    assert "pc.jsonl: all 3 prompt-completion records; alpaca.jsonl: all 2 alpaca records" in \
        describe_prepared(prepared, config)
    train, _ = samples_for(prepared, config)
    batches = [train.batch([k]) for k in range(len(train))]  # the byte tokenizer: one id per byte, 256 its EOS
    texts = ["".join(chr(i) for i in b["input_ids"][0, : int(b["attention_mask"][0].sum())].tolist() if i != 256)
             for b in batches]
    assert texts.count("abc") == 3 and texts.count(ALPACA_PROMPT_NO_INPUT.format(instruction="Say hi") + "Hi") == 2


def test_the_same_config_takes_the_same_records_and_a_new_seed_others(tmp_path):
    _jsonl(tmp_path / "chat.jsonl", _chats(50))
    _jsonl(tmp_path / "alpaca.jsonl", _alpaca(10))
    tok = _tokenizer(tmp_path)

    def stream(seed: int):
        config = _config(tmp_path, {"tokenizer": tok, "datasets": [{"path": "chat.jsonl", "samples": 20},
                                                                   {"path": "alpaca.jsonl"}]}, seed=seed)
        prepared = prepare_data(config)
        return prepared.train.directory.name, np.asarray(prepared.train.tokens).tobytes()

    first = stream(0)
    assert stream(0) == first
    assert stream(1)[0] != first[0]  # the records taken are part of the cache key


def test_files_of_different_columns_in_one_list_load_side_by_side(tmp_path):
    """One load call over chat and Alpaca files fails in datasets (CastError); each run of files of the
    same columns is then read and detected on its own."""
    _jsonl(tmp_path / "a_chat.jsonl", _chats(3))
    _jsonl(tmp_path / "b_alpaca.jsonl", _alpaca(2))
    _jsonl(tmp_path / "c_chat.jsonl", _chats(4))
    tok = _tokenizer(tmp_path)
    for data in ({"train_files": ["a_chat.jsonl", "b_alpaca.jsonl", "c_chat.jsonl"]},
                 {"datasets": [{"path": "*.jsonl", "samples": 5}]}):
        prepared = prepare_data(_config(tmp_path, {"tokenizer": tok, **data}))
        assert prepared.train.meta["record_format"] == "chat"
        expected = 9 if "train_files" in data else 5
        assert prepared.train.num_documents == expected
    assert prepared.train.meta["mix"][0]["record_format"] == "chat + alpaca"


# --- what cannot share a stream -------------------------------------------------------------------


def _refused(tmp_path: Path, data: dict) -> UserError:
    with pytest.raises(UserError) as err:
        prepare_data(_config(tmp_path, data))
    assert len(err.value.problems) == 1 and err.value.problems[0].fix
    return err.value


def test_text_beside_chat_records_is_one_error_naming_both_files(tmp_path):
    _jsonl(tmp_path / "chat.jsonl", _chats(2))
    (tmp_path / "notes.txt").write_text("plain text\n")
    err = _refused(tmp_path, {"tokenizer": _tokenizer(tmp_path), "datasets": [{"path": "chat.jsonl"},
                                                                              {"path": "notes.txt"}]})
    problem = err.problems[0]
    assert problem.where == "data.datasets[1]" and "chat.jsonl" in problem.message and "notes.txt" in problem.message
    assert "chat records" in problem.message and "text records" in problem.message


def test_preference_pairs_beside_sft_records_are_one_error_naming_both_files(tmp_path):
    _jsonl(tmp_path / "alpaca.jsonl", _alpaca(2))
    _jsonl(tmp_path / "pairs.jsonl", [{"prompt": "say hi", "chosen": "hi", "rejected": "no"}] * 2)
    err = _refused(tmp_path, {"datasets": [{"path": "alpaca.jsonl"}, {"path": "pairs.jsonl"}]})
    problem = err.problems[0]
    assert "alpaca.jsonl" in problem.message and "pairs.jsonl" in problem.message
    assert "preference loss" in problem.message


def test_a_source_of_no_known_shape_names_its_columns_and_the_shapes_expected(tmp_path):
    _jsonl(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}])
    problem = _refused(tmp_path, {"datasets": [{"path": "odd.jsonl"}]}).problems[0]
    assert problem.where == "data.datasets[0]" and "odd.jsonl" in problem.message
    assert "['question', 'answer']" in problem.message
    for shape in ("'messages'", "'prompt' + 'completion'", "'instruction' + 'output'", "'chosen' + 'rejected'"):
        assert shape in problem.message
    assert "data.columns" in problem.fix


def test_a_sources_own_columns_read_its_records(tmp_path):
    _jsonl(tmp_path / "qa.jsonl", [{"question": "capital of france", "answer": "paris"}])
    _jsonl(tmp_path / "chat.jsonl", _chats(1))
    config = _config(tmp_path, {"tokenizer": _tokenizer(tmp_path), "datasets": [
        {"path": "qa.jsonl", "columns": {"prompt": "question", "completion": "answer"}}, {"path": "chat.jsonl"}]})
    samples = dict(_samples(tmp_path, config))
    qa = ("<|im_start|>", "user", "capital", "of", "france", "<|im_end|>", "<|im_start|>", "assistant", "paris",
          "<|im_end|>")
    assert samples[qa] == [None] * 8 + ["paris", "<|im_end|>"]
