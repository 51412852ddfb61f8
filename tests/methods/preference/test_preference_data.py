"""Preference records become the right sequences: pairs (text or messages, with a prompt or an implicit
one) and labelled answers are detected from their columns, each sequence's tokens and labels are
checked one by one against what is written down here (the loss on the answers only, never the
prompt), chosen and rejected are cut alike (by default their shared prompt from the left, so both
answers stay whole; an unpaired answer's mismatched sequence too), packed records keep every sequence apart with
its own positions, and every bad input is one error with the YAML path and a fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrate.config.load import config_from_dict
from orchestrate.data.blocks import IGNORE_INDEX
from orchestrate.data.chat_templates import CHATML
from orchestrate.data.pipeline import describe_prepared, prepare_data, samples_for
from orchestrate.data.records import detect_format
from orchestrate.errors import UserError
from orchestrate.methods.registry import method_data
from tests.helpers.chat_tokenizers import word_chat_tokenizer
from tests.helpers.plans import TINY_GPT2

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["user", "assistant", "capital", "of", "france", "paris", "rome", "yes", "no", "say", "hi", "hello", "bye"]
PAIR = {"prompt": "capital of france", "chosen": "paris", "rejected": "rome"}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(tmp_path: Path, data: dict, preference: dict | None = None, seq_len: int = 32):
    arch = {**TINY_GPT2, "vocab_size": 300, "n_positions": 128}
    raw = {"model": {"architecture": arch}, "train": {"seq_len": seq_len, "global_batch_size": 2},
           "data": {"num_proc": 1, "packing": False, "validation_ratio": 0.0, **data}}
    if preference is not False:
        raw["preference"] = preference or {}
    return config_from_dict(raw, tmp_path)


def _chatml(tmp_path: Path) -> str:
    word_chat_tokenizer(tmp_path / "tok", WORDS, CHATML_SPECIALS, eos="<|im_end|>", template=CHATML.source)
    return "tok"


def _views(tmp_path: Path, rows: list[dict], data: dict | None = None, **kw):
    _jsonl(tmp_path / "prefs.jsonl", rows)
    config = _config(tmp_path, {"train_files": ["prefs.jsonl"], **(data or {})}, **kw)
    methods = method_data(config)  # the preference method's reader of its records
    return samples_for(prepare_data(config, methods=methods), config, methods=methods)


def _sequences(tmp_path: Path, rows: list[dict], data: dict | None = None, **kw) -> list[list[tuple]]:
    """Per record, its two sequences as (tokens, labels): a label is the token it scores, None where -100."""
    from transformers import AutoTokenizer

    train, _ = _views(tmp_path, rows, data, **kw)
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok") if (data or {}).get("tokenizer") else None
    name = (lambda i: tok.convert_ids_to_tokens(i)) if tok else (lambda i: "EOS" if i == 256 else chr(i))
    return [[([name(i) for i in ids.tolist()], [None if x == IGNORE_INDEX else name(x) for x in labels.tolist()])
             for ids, labels in train.sequences(k)] for k in range(train.samples)]


@pytest.mark.parametrize(("columns", "expected"), [
    (["prompt", "chosen", "rejected"], "preference"),
    (["chosen", "rejected"], "preference"),                        # the prompt inside the conversations
    (["prompt", "completion", "label"], "unpaired-preference"),    # KTO's unpaired records
    (["prompt", "completion"], "prompt-completion"),
])
def test_preference_records_are_detected_from_their_columns(tmp_path, columns, expected):
    assert detect_format(columns, _config(tmp_path, {}).data) == expected


def test_a_text_pair_scores_each_answer_and_its_eos_after_the_same_prompt(tmp_path):
    (chosen, rejected), = _sequences(tmp_path, [{"prompt": "Q:", "chosen": "ab", "rejected": "xyz"}])
    assert chosen == (["Q", ":", "a", "b", "EOS"], [None, None, "a", "b", "EOS"])
    assert rejected == (["Q", ":", "x", "y", "z", "EOS"], [None, None, "x", "y", "z", "EOS"])


def test_a_chat_pair_scores_the_assistant_answers_only(tmp_path):
    row = {"prompt": [{"role": "user", "content": "capital of france"}],
           "chosen": [{"role": "assistant", "content": "paris"}], "rejected": [{"role": "assistant", "content": "rome"}]}
    (chosen, rejected), = _sequences(tmp_path, [row], {"tokenizer": _chatml(tmp_path)})
    prompt = ["<|im_start|>", "user", "capital", "of", "france", "<|im_end|>", "<|im_start|>", "assistant"]
    assert chosen == ([*prompt, "paris", "<|im_end|>"], [None] * 8 + ["paris", "<|im_end|>"])
    assert rejected == ([*prompt, "rome", "<|im_end|>"], [None] * 8 + ["rome", "<|im_end|>"])


def test_eval_generate_asks_the_prompt_and_expects_the_chosen_or_desirable_answer(tmp_path):
    # train.eval_generate (worker/callbacks/generate.py) reads prompt_and_answer: a pair's prompt and chosen
    # answer with its EOS, an unpaired answer's only where it is desirable (nothing to imitate otherwise)
    (tmp_path / "pairs").mkdir()
    pairs, _ = _views(tmp_path / "pairs", [{"prompt": "Q:", "chosen": "ab", "rejected": "xyz"}])
    assert pairs.prompt_and_answer(0) == ([ord("Q"), ord(":")], [ord("a"), ord("b"), 256])
    (tmp_path / "kto").mkdir()
    rows = [{"prompt": "Q:", "completion": "ab", "label": True}, {"prompt": "R:", "completion": "cd", "label": False}]
    answers, _ = _views(tmp_path / "kto", rows, preference={"loss": "kto"})
    assert [answers.prompt_and_answer(k) for k in range(2)] == [([ord("Q"), ord(":")], [ord("a"), ord("b"), 256]), None]


def test_an_implicit_prompt_is_the_turns_both_conversations_share(tmp_path):
    user = {"role": "user", "content": "capital of france"}
    explicit = {"prompt": [user], "chosen": [{"role": "assistant", "content": "paris"}],
                "rejected": [{"role": "assistant", "content": "rome"}]}
    implicit = {"chosen": [user, {"role": "assistant", "content": "paris"}],
                "rejected": [user, {"role": "assistant", "content": "rome"}]}
    found = []
    for name, row in (("implicit", implicit), ("explicit", explicit)):
        (tmp_path / name).mkdir()
        found.append(_sequences(tmp_path / name, [row], {"tokenizer": _chatml(tmp_path / name)}))
    assert found[0] == found[1]
    assert found[0][0][0][1][-2:] == ["paris", "<|im_end|>"]


def test_earlier_assistant_turns_of_the_prompt_are_not_scored(tmp_path):
    row = {"prompt": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hello"},
                      {"role": "user", "content": "capital of france"}],
           "chosen": [{"role": "assistant", "content": "paris"}], "rejected": [{"role": "assistant", "content": "rome"}]}
    (chosen, _), = _sequences(tmp_path, [row], {"tokenizer": _chatml(tmp_path)})
    assert [label for label in chosen[1] if label] == ["paris", "<|im_end|>"]


def test_a_chat_template_in_the_yaml_renders_text_pairs_as_one_turn_each(tmp_path):
    (chosen, _), = _sequences(tmp_path, [PAIR], {"tokenizer": _chatml(tmp_path), "chat_template": "chatml"})
    assert chosen[0] == ["<|im_start|>", "user", "capital", "of", "france", "<|im_end|>", "<|im_start|>", "assistant",
                         "paris", "<|im_end|>"]


def test_a_long_pair_keeps_both_answers_whole_and_cuts_its_prompt_alike(tmp_path):
    rows = [{"prompt": "P" * 20 + "Q:", "chosen": "abc", "rejected": "de"},  # 26 and 25 tokens: 16 prompt tokens go
            {"prompt": "Q:", "chosen": "a" * 20, "rejected": "b"}]           # the chosen answer alone is too long
    _jsonl(tmp_path / "prefs.jsonl", rows)
    config = _config(tmp_path, {"train_files": ["prefs.jsonl"]}, seq_len=10)
    assert config.data.truncation == "keep_answer"
    methods = method_data(config)
    prepared = prepare_data(config, methods=methods)
    train, _ = samples_for(prepared, config, methods=methods)
    assert (train.samples, train.kept.truncated, train.kept.dropped) == (1, 1, 1)
    (c_ids, c_labels), (r_ids, r_labels) = train.sequences(0)
    assert c_ids.tolist() == [*b"PPPPQ:abc", 256] and r_ids.tolist() == [*b"PPPPQ:de", 256]
    assert [x for x in c_labels.tolist() if x != IGNORE_INDEX] == [*b"abc", 256]
    assert [x for x in r_labels.tolist() if x != IGNORE_INDEX] == [*b"de", 256]
    assert ("pairs: 1 had their prompt cut from the left to fit seq_len 10 (keep_answer); 1 dropped: an answer "
            "that does not fit in seq_len 10") in describe_prepared(prepared, config, methods)


def test_a_long_unpaired_answer_and_its_mismatched_sequence_keep_their_answers(tmp_path):
    rows = [{"prompt": "A" * 20, "completion": "x", "label": True}, {"prompt": "B:", "completion": "yz", "label": False}]
    train, _ = _views(tmp_path, rows, seq_len=8, preference={"loss": "kto"})
    (own, own_labels), (mismatched, _) = train.sequences(0)
    assert own.tolist() == [*b"AAAAAAx", 256] and [x for x in own_labels.tolist() if x != IGNORE_INDEX] == [ord("x"), 256]
    assert mismatched.tolist() == [*b"AAAAAyz", 256]  # its prompt cut further, so the other answer fits whole
    assert train.kept.truncated == 1


def test_long_pairs_are_cut_alike_at_their_end_under_keep_start(tmp_path):
    rows = [{"prompt": "Q:", "chosen": "a" * 20, "rejected": "b" * 3},       # the chosen sequence is cut
            {"prompt": "P" * 12, "chosen": "x", "rejected": "y"}]           # the prompt fills seq_len: dropped
    train, _ = _views(tmp_path, rows, {"truncation": "keep_start"}, seq_len=10)
    assert train.samples == 1 and train.kept.truncated == 1 and train.kept.dropped == 1
    (c_ids, c_labels), (r_ids, r_labels) = train.sequences(0)
    assert len(c_ids) == 10 and len(r_ids) == 6
    assert c_ids[:2].tolist() == r_ids[:2].tolist() == [ord("Q"), ord(":")]
    assert (c_labels[2:] != IGNORE_INDEX).all() and (c_labels[:2] == IGNORE_INDEX).all()


@pytest.mark.parametrize(("policy", "kept", "dropped"), [
    ("keep_answer", 1, 1),   # the chosen answer alone is longer than seq_len
    ("keep_start", 2, 0),
    ("drop", 1, 1),
])
def test_the_truncation_policy_applies_to_whole_pairs(tmp_path, policy, kept, dropped):
    rows = [PAIR, {"prompt": "Q:", "chosen": "a" * 40, "rejected": "b"}]
    train, _ = _views(tmp_path, rows, {"truncation": policy}, seq_len=24)
    assert (train.samples, train.kept.dropped) == (kept, dropped)


def test_truncation_error_names_the_record(tmp_path):
    with pytest.raises(UserError) as info:
        _views(tmp_path, [PAIR, {"prompt": "Q:", "chosen": "a" * 40, "rejected": "b"}], {"truncation": "error"},
               seq_len=24)
    assert info.value.problems[0].where == "data.truncation"
    assert "record 1" in info.value.problems[0].message


def test_a_padded_batch_holds_the_chosen_rows_then_the_rejected_ones(tmp_path):
    train, _ = _views(tmp_path, [PAIR, {"prompt": "Q:", "chosen": "ab", "rejected": "c"}])
    batch = train.batch([1, 0])
    assert batch["input_ids"].shape == (4, 32)
    rows = [batch["input_ids"][r, : int(batch["attention_mask"][r].sum())].tolist() for r in range(4)]
    expected = [train.sequences(1)[0][0], train.sequences(0)[0][0], train.sequences(1)[1][0], train.sequences(0)[1][0]]
    assert rows == [e.tolist() for e in expected]
    assert batch["sequence"][:, 0].tolist() == [0, 1, 2, 3]
    assert batch["record_index"].tolist() == [1, 0]


def test_packed_records_keep_every_sequence_apart(tmp_path):
    rows = [PAIR, {"prompt": "Q:", "chosen": "ab", "rejected": "c"}, {"prompt": "R:", "chosen": "d", "rejected": "ef"}]
    train, _ = _views(tmp_path, rows, {"packing": True}, seq_len=20)
    batch = train.batch(list(range(len(train))))
    records = batch["record_index"].tolist()
    n = len(records)
    assert sorted(records) == [0, 1, 2]
    for j, doc in enumerate(records):
        k = list(train.kept.docs).index(doc)
        for side, (ids, labels) in enumerate(train.sequences(k)):
            where = batch["sequence"] == side * n + j
            assert batch["input_ids"][where].tolist() == ids.tolist()
            assert batch["labels"][where].tolist() == labels.tolist()
            assert batch["position_ids"][where].tolist() == list(range(len(ids)))  # attention within it
    assert (batch["labels"][batch["sequence"] == -1] == IGNORE_INDEX).all()


def test_an_unpaired_answer_comes_with_its_prompt_and_the_previous_answer(tmp_path):
    rows = [{"prompt": "A:", "completion": "x", "label": True}, {"prompt": "B:", "completion": "yz", "label": False}]
    train, _ = _views(tmp_path, rows, preference={"loss": "kto"})
    (own, _), (mismatched, mismatched_labels) = train.sequences(1)
    assert own.tolist() == [ord(c) for c in "B:yz"] + [256]
    assert mismatched.tolist() == [ord(c) for c in "B:x"] + [256]
    assert mismatched_labels.tolist() == [IGNORE_INDEX, IGNORE_INDEX, ord("x"), 256]
    assert train.batch([0, 1])["desirable"].tolist() == [True, False]


# --- bad input: one error with the YAML path and a fix ---------------------------------------------


def _problem(tmp_path: Path, rows: list[dict], data: dict | None = None, **kw):
    with pytest.raises(UserError) as info:
        _views(tmp_path, rows, data, **kw)
    (problem,) = info.value.problems
    assert problem.fix
    return info.value.headline, problem


def test_a_pair_without_a_rejected_answer_is_refused(tmp_path):
    headline, problem = _problem(tmp_path, [PAIR, {"prompt": "Q:", "chosen": "a", "rejected": None}])
    assert problem.where.startswith("data.train_files") and "record 1" in problem.message and "'rejected'" in problem.message


def test_data_without_a_rejected_column_is_not_preference_data(tmp_path):
    headline, problem = _problem(tmp_path, [{"prompt": "Q:", "chosen": "a"}])
    assert "preference.loss dpo trains on preference records" in headline
    assert "chosen and rejected" in problem.fix


def test_identical_chosen_and_rejected_answers_are_refused(tmp_path):
    _, problem = _problem(tmp_path, [PAIR, {"prompt": "Q:", "chosen": "same", "rejected": "same"}])
    assert "record 1" in problem.message and "identical" in problem.message


def test_identical_conversations_have_no_answer_to_compare(tmp_path):
    turns = [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hello"}]
    _, problem = _problem(tmp_path, [{"chosen": turns, "rejected": turns}], {"tokenizer": _chatml(tmp_path)})
    assert "identical" in problem.message


def test_preference_records_without_a_preference_section_are_refused(tmp_path):
    headline, problem = _problem(tmp_path, [PAIR], preference=False)
    assert "preference records" in headline and "preference:" in problem.fix


def test_kto_needs_labelled_answers(tmp_path):
    headline, _ = _problem(tmp_path, [PAIR], preference={"loss": "kto"})
    assert "unpaired-preference" in headline


def test_an_unpaired_label_must_be_true_or_false(tmp_path):
    _, problem = _problem(tmp_path, [{"prompt": "A:", "completion": "x", "label": "good"}], preference={"loss": "kto"})
    assert problem.where == "data.columns (unpaired-preference records)" and "true / false" in problem.fix


def test_message_answers_need_a_chat_template(tmp_path):
    word_chat_tokenizer(tmp_path / "tok", WORDS, CHATML_SPECIALS, eos="<|im_end|>", template=None)
    row = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "yes"}],
           "rejected": [{"role": "assistant", "content": "no"}]}
    _, problem = _problem(tmp_path, [row], {"tokenizer": "tok"})
    assert problem.where == "data.tokenizer" and "chat_template" in problem.fix


def test_pairs_whose_answers_alone_exceed_seq_len_are_told_as_that_under_keep_answer(tmp_path):
    """keep_answer cuts the prompt away, yet an answer longer than seq_len cannot train: the message
    says the answers alone do not fit, not "add data" nor to set the policy it already has."""
    from orchestrate.data.pipeline import require_sample_per_rank

    rows = [{"prompt": "P", "chosen": "x" * 30 + str(i), "rejected": "y"} for i in range(3)]
    _jsonl(tmp_path / "prefs.jsonl", rows)
    config = _config(tmp_path, {"train_files": ["prefs.jsonl"], "truncation": "keep_answer"}, seq_len=24)
    methods = method_data(config)
    prepared = prepare_data(config, methods=methods)
    train, _ = samples_for(prepared, config, methods=methods)
    with pytest.raises(UserError) as refused:
        require_sample_per_rank(train, 2, prepared, config)
    (problem,) = refused.value.problems
    assert problem.message.startswith("all 3 samples are longer than train.seq_len 24 with their prompt cut away: "
                                      "their last answer alone does not fit")
    assert "shorten the answers" in problem.fix and "add data" not in str(refused.value)


@pytest.mark.parametrize(("policy", "says", "fix"), [
    ("drop", "data.truncation: drop leaves each out", "set data.truncation: keep_answer"),
    ("truncate", "cut to their first 24 tokens they have no token left to train on", "raise train.seq_len"),
])
def test_pairs_all_longer_than_seq_len_are_told_as_that_not_as_too_little_data(tmp_path, policy, says, fix):
    """Every pair's prompt alone fills seq_len: `prepare` and the launcher say all pairs were longer
    than train.seq_len and what to set, not "add data"."""
    from orchestrate.data.checks import require_training_samples
    from orchestrate.data.pipeline import dropped_for_length, require_sample_per_rank

    rows = [{"prompt": "P" * 30 + str(i), "chosen": "x", "rejected": "y"} for i in range(3)]
    _jsonl(tmp_path / "prefs.jsonl", rows)
    config = _config(tmp_path, {"train_files": ["prefs.jsonl"], "truncation": policy}, seq_len=24)
    methods = method_data(config)
    prepared = prepare_data(config, methods=methods)
    train, _ = samples_for(prepared, config, methods=methods)
    with pytest.raises(UserError) as by_prepare:
        require_training_samples(len(train), 99, 24, False, "data.train_files[0]", dropped_for_length(train, config))
    with pytest.raises(UserError) as by_launcher:
        require_sample_per_rank(train, 2, prepared, config)
    for error in (by_prepare.value, by_launcher.value):
        (problem,) = error.problems
        assert problem.message.startswith("all 3 samples are longer than train.seq_len 24") and says in problem.message
        assert fix in problem.fix and "add data" not in str(error)
