"""The minimal data path: tokenisers, documents, packing, validation split, sampler, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from orchestrate.config.load import config_from_dict
from orchestrate.data.corpus import demo_corpus, read_documents, write_demo_corpus
from orchestrate.data.packing import pack, split_validation
from orchestrate.data.pipeline import DEMO_CORPUS_ROLE, build_data, check_data_config
from orchestrate.data.sampler import DistributedBlockSampler
from orchestrate.data.tokenizer import BYTE_EOS, ByteTokenizer, HFTokenizer
from orchestrate.errors import UserError
from tests.helpers.plans import TINY_GPT2


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "Grüße, 世界! \n\t end"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.vocab_size == 257 and tok.eos_id == BYTE_EOS
    assert tok.decode(ids) == text
    assert tok.decode(ids + [BYTE_EOS]) == text  # EOS is not text


def test_hf_tokenizer_from_local_directory(tmp_path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<eos>": 1, "hello": 2, "world": 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="[UNK]").save_pretrained(tmp_path)
    tok = HFTokenizer(tmp_path)
    assert tok.encode("hello world") == [2, 3]
    assert tok.eos_id == 1 and tok.vocab_size == 4


def test_hf_tokenizer_missing_directory_is_a_user_error(tmp_path: Path):
    with pytest.raises(UserError, match="not found"):
        HFTokenizer(tmp_path / "nope")


def test_txt_documents_are_blank_line_separated_paragraphs(tmp_path: Path):
    f = tmp_path / "a.txt"
    f.write_text("first doc\nline two\n\n\n  \nsecond doc\n\nthird\n")
    assert list(read_documents(f, "text", "x")) == ["first doc\nline two", "second doc", "third"]


def test_jsonl_documents_and_missing_field_names_file_and_field(tmp_path: Path):
    f = tmp_path / "a.jsonl"
    f.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"body": "two"}) + "\n")
    docs = read_documents(f, "text", "data.train_files[0]")
    assert next(docs) == "one"
    with pytest.raises(UserError) as err:
        next(docs)
    message = str(err.value)
    assert str(f) in message and "'text'" in message and "body" in message


def test_missing_file_is_a_user_error(tmp_path: Path):
    with pytest.raises(UserError, match="does not exist"):
        list(read_documents(tmp_path / "missing.txt", "text", "data.train_files[0]"))


def test_pack_joins_documents_with_eos_and_drops_the_tail():
    blocks = pack([[1, 2, 3], [4, 5], [6]], eos_id=9, seq_len=4)
    assert blocks.tolist() == [[1, 2, 3, 9], [4, 5, 9, 6]]  # the trailing [9] is dropped
    assert blocks.dtype == torch.long


def test_validation_split_is_disjoint_seeded_and_keeps_training_data():
    blocks = torch.arange(100).view(100, 1)
    train, val = split_validation(blocks, 0.05, seed=3)
    assert len(val) == 5 and len(train) == 95
    assert set(train.flatten().tolist()).isdisjoint(val.flatten().tolist())
    again_train, again_val = split_validation(blocks, 0.05, seed=3)
    assert torch.equal(val, again_val)
    tiny_train, tiny_val = split_validation(blocks[:2], 0.01, seed=0)
    assert len(tiny_val) == 1 and len(tiny_train) == 1
    assert len(split_validation(blocks, 0.0, seed=0)[1]) == 0


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sampler_shards_are_disjoint_and_cover_an_epoch(world: int):
    n = 30
    per_rank = n // world
    shards = [DistributedBlockSampler(n, r, world, seed=7).take(per_rank) for r in range(world)]
    seen = [i for shard in shards for i in shard]
    assert len(seen) == len(set(seen)) == per_rank * world
    assert set(seen) <= set(range(n))


def test_sampler_epochs_differ_and_roll_over():
    s = DistributedBlockSampler(10, 0, 1, seed=0)
    first, second = s.take(10), s.take(10)
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    assert s.state_dict() == {"epoch": 1, "position": 10, "seed": 0}
    crossing = DistributedBlockSampler(10, 0, 1, seed=0)
    assert crossing.take(15) == first + second[:5]


def test_sampler_state_round_trip_continues_the_same_order():
    a = DistributedBlockSampler(17, 1, 2, seed=5)
    a.take(11)  # into the second epoch
    state = a.state_dict()
    b = DistributedBlockSampler(17, 1, 2, seed=0)
    b.load_state_dict(json.loads(json.dumps(state)))  # it travels as JSON in checkpoints
    assert a.take(20) == b.take(20)


def test_demo_corpus_is_deterministic_and_english_like(tmp_path: Path):
    docs = demo_corpus(seed=0)
    assert docs == demo_corpus(seed=0) and docs != demo_corpus(seed=1)
    assert all(d.endswith(".") for d in docs[:50])
    assert len(set(docs)) == len(docs)
    path = write_demo_corpus(tmp_path / "data" / "demo.txt", seed=0)
    assert list(read_documents(path, "text", "x")) == docs


def _plan_for(tmp_path: Path, data: dict, seq_len: int = 32, **train):
    from orchestrate.model.meta import load_model_config, shape_from_config

    cfg = config_from_dict({"model": {"architecture": dict(TINY_GPT2)},
                            "train": {"seq_len": seq_len, "global_batch_size": 4, **train}, "data": data}, tmp_path)

    class _Plan:  # build_data reads only these attributes
        config = cfg
        shape = shape_from_config(load_model_config(cfg))
        files: dict[str, str] = {}

    return _Plan()


def test_build_data_from_demo_corpus_splits_and_shards(tmp_path: Path):
    plan = _plan_for(tmp_path, {"generate_demo_corpus": True, "validation_ratio": 0.1})
    write_demo_corpus(tmp_path / "corpus.txt", seed=0)
    plan.files = {DEMO_CORPUS_ROLE: "corpus.txt"}
    d0 = build_data(plan, tmp_path, rank=0, world_size=2)
    d1 = build_data(plan, tmp_path, rank=1, world_size=2)
    assert torch.equal(d0.train, d1.train) and d0.train.shape[1] == 32
    assert math.isclose(len(d0.validation) / (len(d0.train) + len(d0.validation)), 0.1, abs_tol=0.01)
    b0, b1 = d0.micro_batch(4), d1.micro_batch(4)
    assert torch.equal(b0["input_ids"], b0["labels"]) and b0["input_ids"].shape == (4, 32)
    assert not torch.equal(b0["input_ids"], b1["input_ids"])
    e0 = d0.eval_batches(2, 3, rank=0, world_size=2)
    assert len(e0) == 3 and e0[0]["input_ids"].shape == (2, 32)
    assert ByteTokenizer().decode(b0["input_ids"][0].tolist()).count(" ") > 3


def test_build_data_validation_files_and_jsonl(tmp_path: Path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"content": "x" * 50}) + "\n" for _ in range(8)))
    (tmp_path / "val.txt").write_text("y" * 100)
    plan = _plan_for(tmp_path, {"train_files": ["train.jsonl"], "validation_files": ["val.txt"],
                                "text_field": "content"})
    data = build_data(plan, tmp_path, rank=0, world_size=1)
    assert len(data.train) == (8 * 51) // 32 and len(data.validation) == 101 // 32


def test_build_data_errors(tmp_path: Path):
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(UserError, match="not enough training data"):
        build_data(_plan_for(tmp_path, {"train_files": ["short.txt"]}), tmp_path, 0, 1)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(UserError, match="not enough training data"):
        build_data(_plan_for(tmp_path, {"train_files": ["empty.txt"]}), tmp_path, 0, 1)
    with pytest.raises(UserError, match="no training files given"):
        build_data(_plan_for(tmp_path, {}), tmp_path, 0, 1)
    with pytest.raises(UserError, match="no demo corpus"):
        build_data(_plan_for(tmp_path, {"generate_demo_corpus": True}), tmp_path, 0, 1)
    with pytest.raises(UserError, match="64 positions"):  # TINY_GPT2 has n_positions 64
        build_data(_plan_for(tmp_path, {"generate_demo_corpus": True}, seq_len=65), tmp_path, 0, 1)


def test_check_data_config_reports_every_problem(tmp_path: Path):
    (tmp_path / "notes.csv").write_text("a,b")
    cfg = config_from_dict({"model": {"architecture": dict(TINY_GPT2)},
                            "train": {"seq_len": 128, "global_batch_size": 4},
                            "data": {"train_files": ["missing.txt", "notes.csv"]}}, tmp_path)
    with pytest.raises(UserError) as err:
        check_data_config(cfg, max_positions=64, vocab_size=100)
    wheres = [p.where for p in err.value.problems]
    assert wheres == ["data.train_files[0]", "data.train_files[1]", "train.seq_len", "data.tokenizer"]
    assert "64 positions" in str(err.value)
