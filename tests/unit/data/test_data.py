"""The data path: formats, tokenisers, the cache (hit, damage, atomic writes), packing and padding,
validation splits, build_data, and every bad-input error."""

from __future__ import annotations

import gzip
import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from orchestrate.config.load import config_from_dict
from orchestrate.data.blocks import IGNORE_INDEX, PackedBlocks, PaddedDocuments, Subset, split_ids
from orchestrate.data.cache import TOKENS_FILE, open_entry
from orchestrate.data.corpus import demo_corpus, write_demo_corpus
from orchestrate.data.pipeline import build_data, check_data_config, prepare_data
from orchestrate.data.prepare import _wait_for
from orchestrate.data.tokenizer import BYTE_EOS, ByteTokenizer, HFTokenizer, token_dtype
from orchestrate.errors import UserError
from orchestrate.planner.plan import RunFiles
from tests.helpers.plans import TINY_GPT2
from tests.helpers.word_tokenizers import word_tokenizer

DOCS = ["The cat sees the dog.", "Grüße, 世界!", "A third, longer document about the river and the tree."]


def _config(tmp_path: Path, data: dict, seq_len: int = 8, **train):
    return config_from_dict({"model": {"architecture": dict(TINY_GPT2)},
                             "train": {"seq_len": seq_len, "global_batch_size": 4, **train},
                             "data": {"num_proc": 1, **data}}, tmp_path)


def _plan(config, files: RunFiles | None = None):
    from orchestrate.model.meta import load_model_config, shape_from_config

    class _Plan:  # build_data reads only these attributes
        pass

    plan = _Plan()
    plan.config, plan.files = config, files or RunFiles()
    plan.shape = shape_from_config(load_model_config(config))
    return plan


def _expected_stream(docs: list[str]) -> list[int]:
    return [i for d in docs for i in [*d.encode("utf-8"), BYTE_EOS]]


def _stream(prepared) -> list[int]:
    return prepared.train.tokens.tolist()


# --- tokenizers -------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "Grüße, 世界! \n\t end"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.vocab_size == 257 and tok.eos_id == BYTE_EOS
    assert tok.decode(ids) == text
    assert tok.decode(ids + [BYTE_EOS]) == text  # EOS is not text
    assert [list(a) for a in tok.encode_batch([text, ""])] == [ids, []]


def test_hf_tokenizer_from_local_directory_and_its_content_fingerprint(tmp_path: Path):
    tok = HFTokenizer(word_tokenizer(tmp_path / "a", ["hello", "world"]))
    assert tok.encode("hello world") == [2, 3] and tok.encode_batch(["world", "hello"]) == [[3], [2]]
    assert tok.eos_id == 1 and tok.vocab_size == 4
    same = HFTokenizer(word_tokenizer(tmp_path / "b", ["hello", "world"]))
    other = HFTokenizer(word_tokenizer(tmp_path / "c", ["hello", "there"]))
    assert tok.fingerprint() == same.fingerprint() != other.fingerprint()


def test_hf_tokenizer_missing_directory_is_a_user_error(tmp_path: Path):
    with pytest.raises(UserError, match="not found"):
        HFTokenizer(tmp_path / "nope")


def test_token_dtype_is_uint16_below_65536_ids():
    assert token_dtype(257) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


# --- formats ------------------------------------------------------------------------------------


def _write(fmt: str, root: Path, docs: list[str]) -> str:
    """`docs` in one format under `root`; returns the train_files entry."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    rows = [{"text": d, "id": i} for i, d in enumerate(docs)]
    if fmt == "txt":
        (root / "a.txt").write_text("\n\n".join(docs) + "\n")
        return "a.txt"
    if fmt == "jsonl":
        (root / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return "a.jsonl"
    if fmt == "json.gz":
        with gzip.open(root / "a.json.gz", "wt") as f:
            json.dump(rows, f)
        return "a.json.gz"
    if fmt in ("csv", "tsv"):
        import pandas as pd

        pd.DataFrame(rows).to_csv(root / f"a.{fmt}", index=False, sep="," if fmt == "csv" else "\t")
        return f"a.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), root / "a.parquet")
        return "a.parquet"
    if fmt == "parquet dir + glob":  # two shards, found by a glob, in name order
        (root / "shards").mkdir()
        pq.write_table(pa.Table.from_pylist(rows[:1]), root / "shards" / "part-0.parquet")
        pq.write_table(pa.Table.from_pylist(rows[1:]), root / "shards" / "part-1.parquet")
        return "shards/*.parquet"
    if fmt == "arrow dir":  # Dataset.save_to_disk
        datasets.Dataset.from_list(rows).save_to_disk(str(root / "saved"))
        return "saved"
    if fmt == "arrow files dir":  # a directory of .arrow files (Arrow IPC streams, as datasets writes them)
        (root / "arrows").mkdir()
        table = pa.Table.from_pylist(rows)
        with pa.OSFile(str(root / "arrows" / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        return "arrows"
    raise ValueError(fmt)


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "json.gz", "csv", "tsv", "parquet", "parquet dir + glob",
                                 "arrow dir", "arrow files dir"])
def test_every_format_gives_the_same_token_stream(tmp_path: Path, fmt: str):
    entry = _write(fmt, tmp_path, DOCS)
    prepared = prepare_data(_config(tmp_path, {"train_files": [entry]}))
    assert _stream(prepared) == _expected_stream(DOCS)
    assert prepared.train.tokens.dtype == np.uint16 and prepared.train.num_documents == len(DOCS)
    assert prepared.tokenized == ["train"]


def test_mixed_formats_keep_the_listed_order(tmp_path: Path):
    a = _write("jsonl", tmp_path / "x", DOCS[:1])
    b = _write("txt", tmp_path / "y", DOCS[1:])
    prepared = prepare_data(_config(tmp_path, {"train_files": [f"y/{b}", f"x/{a}"]}))
    assert _stream(prepared) == _expected_stream(DOCS[1:] + DOCS[:1])


def test_text_units_paragraph_line_file(tmp_path: Path):
    (tmp_path / "a.txt").write_text("first doc\nline two\n\n\n  \nsecond doc\n\nthird\n")
    by = {unit: prepare_data(_config(tmp_path, {"train_files": ["a.txt"], "text_unit": unit}))
          for unit in ("paragraph", "line", "file")}
    assert _stream(by["paragraph"]) == _expected_stream(["first doc\nline two", "second doc", "third"])
    assert _stream(by["line"]) == _expected_stream(["first doc", "line two", "second doc", "third"])
    assert by["file"].train.num_documents == 1


def test_template_makes_one_document_per_record(tmp_path: Path):
    rows = [{"prompt": "2+2?", "response": "4"}, {"prompt": "Capital of France?", "response": "Paris"}]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = "Q: {prompt}\nA: {response}"
    prepared = prepare_data(_config(tmp_path, {"train_files": ["sft.jsonl"], "template": template}))
    assert _stream(prepared) == _expected_stream([template.format(**r) for r in rows])


# --- packing, padding, splits ---------------------------------------------------------------------


def test_packing_joins_documents_with_eos_and_drops_the_tail(tmp_path: Path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["abc", "de", "f"]))
    prepared = prepare_data(_config(tmp_path, {"train_files": ["a.jsonl"]}))
    blocks = PackedBlocks(prepared.train, seq_len=4)
    assert blocks.shape == (2, 4)  # 9 tokens: the trailing EOS is dropped
    batch = blocks.batch([0, 1])
    assert batch["input_ids"].tolist() == [[97, 98, 99, 256], [100, 101, 256, 102]]
    assert batch["input_ids"].dtype == torch.long and torch.equal(batch["labels"], batch["input_ids"])


def test_padding_masks_pads_and_truncates(tmp_path: Path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["abc", "de", "fghijk"]))
    prepared = prepare_data(_config(tmp_path, {"train_files": ["a.jsonl"], "packing": False}))
    docs = PaddedDocuments(prepared.train, seq_len=4)
    assert docs.shape == (3, 4) and docs.truncated() == 1
    batch = docs.batch([0, 1, 2])
    assert batch["input_ids"].tolist() == [[97, 98, 99, 256], [100, 101, 256, 256], [102, 103, 104, 105]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["labels"].tolist()[1] == [100, 101, 256, IGNORE_INDEX]


def test_validation_split_is_disjoint_seeded_and_keeps_training_data():
    held = split_ids(100, 0.05, seed=3)
    train, val = Subset(100, held, keep_held_out=False), Subset(100, held, keep_held_out=True)
    assert len(val) == 5 and len(train) == 95
    train_ids, val_ids = train.ids(np.arange(95)), val.ids(np.arange(5))
    assert sorted(train_ids.tolist() + val_ids.tolist()) == list(range(100))  # disjoint, complete, ordered
    assert np.all(np.diff(train_ids) > 0)
    assert np.array_equal(held, split_ids(100, 0.05, seed=3)) and not np.array_equal(held, split_ids(100, 0.05, 4))
    assert len(split_ids(2, 0.01, 0)) == 1 and len(split_ids(100, 0.0, 0)) == 0 and len(split_ids(1, 0.5, 0)) == 0


def test_validation_files_and_a_validation_split_of_a_dataset_dict(tmp_path: Path):
    import datasets

    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"content": "x" * 50}) + "\n" for _ in range(8)))
    (tmp_path / "val.txt").write_text("y" * 100)
    cfg = _config(tmp_path, {"train_files": ["train.jsonl"], "validation_files": ["val.txt"],
                             "text_field": "content"}, seq_len=32)
    data = build_data(_plan(cfg), tmp_path, rank=0, world_size=1)
    assert len(data.train) == (8 * 51) // 32 and len(data.validation) == 101 // 32

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["t" * 70] * 4}),
                          "validation": datasets.Dataset.from_dict({"text": ["v" * 70]})}).save_to_disk(
        str(tmp_path / "dd"))
    cfg = _config(tmp_path, {"dataset": "dd", "validation_split": "validation"}, seq_len=32)
    data = build_data(_plan(cfg), tmp_path, rank=0, world_size=1)
    assert len(data.train) == 4 * 71 // 32 and len(data.validation) == 71 // 32
    assert set(data.validation.batch([0])["input_ids"][0].tolist()) <= {ord("v"), BYTE_EOS}


def test_build_data_from_demo_corpus_splits_and_shards(tmp_path: Path):
    cfg = _config(tmp_path, {"generate_demo_corpus": True, "validation_ratio": 0.1}, seq_len=32)
    write_demo_corpus(tmp_path / "corpus.txt", seed=0)
    plan = _plan(cfg, RunFiles(demo_corpus="corpus.txt"))
    d0 = build_data(plan, tmp_path, rank=0, world_size=2)
    d1 = build_data(plan, tmp_path, rank=1, world_size=2)
    assert d0.train.shape == d1.train.shape and d0.train.shape[1] == 32
    assert math.isclose(len(d0.validation) / (len(d0.train) + len(d0.validation)), 0.1, abs_tol=0.01)
    b0, b1 = d0.micro_batch(4), d1.micro_batch(4)
    assert torch.equal(b0["input_ids"], b0["labels"]) and b0["input_ids"].shape == (4, 32)
    assert not torch.equal(b0["input_ids"], b1["input_ids"])
    e0 = d0.eval_batches(2, 3, rank=0, world_size=2)
    assert len(e0) == 3 and e0[0]["input_ids"].shape == (2, 32)
    assert ByteTokenizer().decode(b0["input_ids"][0].tolist()).count(" ") > 3


def test_demo_corpus_is_deterministic_and_english_like(tmp_path: Path):
    docs = demo_corpus(seed=0)
    assert docs == demo_corpus(seed=0) and docs != demo_corpus(seed=1)
    assert all(d.endswith(".") for d in docs[:50])
    assert len(set(docs)) == len(docs)
    path = write_demo_corpus(tmp_path / "data" / "demo.txt", seed=0)
    cfg = _config(tmp_path, {"train_files": [str(path)]})
    assert prepare_data(cfg).train.num_documents == len(docs)


# --- the cache ----------------------------------------------------------------------------------


@pytest.fixture
def count_tokenizer_calls(monkeypatch):
    calls = {"n": 0}
    original = ByteTokenizer.encode_batch

    def counting(self, texts):
        calls["n"] += 1
        return original(self, texts)

    monkeypatch.setattr(ByteTokenizer, "encode_batch", counting)
    return calls


def test_second_prepare_hits_the_cache_without_tokenizing(tmp_path: Path, count_tokenizer_calls):
    write_demo_corpus(tmp_path / "corpus.txt", seed=0)
    cfg = _config(tmp_path, {"train_files": ["corpus.txt"]})
    first = prepare_data(cfg)
    assert count_tokenizer_calls["n"] > 0 and first.tokenized == ["train"]
    count_tokenizer_calls["n"] = 0
    # Sequence length, packing and the validation split are views: none of them tokenises again.
    for changed in (cfg, _config(tmp_path, {"train_files": ["corpus.txt"], "packing": False}, seq_len=64),
                    _config(tmp_path, {"train_files": ["corpus.txt"], "validation_ratio": 0.2}, seq_len=16)):
        again = prepare_data(changed)
        assert again.tokenized == [] and again.train.directory == first.train.directory
    assert count_tokenizer_calls["n"] == 0
    # build_data on a worker maps the same entry, without tokenising.
    data = build_data(_plan(cfg), tmp_path, rank=0, world_size=2, local_rank=1)
    assert count_tokenizer_calls["n"] == 0 and len(data.train) > 0
    # Different text: a different entry.
    (tmp_path / "corpus.txt").write_text("changed text\n")
    assert prepare_data(cfg).tokenized == ["train"] and count_tokenizer_calls["n"] > 0


def test_the_demo_corpus_of_every_run_directory_shares_one_entry(tmp_path: Path, count_tokenizer_calls):
    cfg = _config(tmp_path, {"generate_demo_corpus": True})
    # A plan without the corpus (not written by prepare_run) generates the same text into the cache.
    assert len(build_data(_plan(cfg), tmp_path, rank=0, world_size=1).train) > 0
    count_tokenizer_calls["n"] = 0
    for run in ("run-1", "run-2"):
        write_demo_corpus(tmp_path / run / "data" / "demo.txt", seed=0)
        prepared = prepare_data(cfg, RunFiles(demo_corpus="data/demo.txt"), tmp_path / run)
        assert prepared.tokenized == []
    assert count_tokenizer_calls["n"] == 0
    assert len([p for p in (tmp_path / "runs" / "data_cache").iterdir() if p.name.startswith("demo_corpus-")]) == 1


def test_a_damaged_entry_is_a_user_error_and_force_rebuilds_it(tmp_path: Path):
    _write("jsonl", tmp_path, DOCS)
    cfg = _config(tmp_path, {"train_files": ["a.jsonl"], "cache_dir": "cache"})
    entry = prepare_data(cfg).train.directory
    assert entry.parent == tmp_path / "cache"
    with open(entry / TOKENS_FILE, "r+b") as f:
        f.truncate(10)
    with pytest.raises(UserError) as err:
        prepare_data(cfg)
    assert str(entry) in str(err.value) and "data.cache_dir" in str(err.value) and "--force" in str(err.value)
    rebuilt = prepare_data(cfg, force=True)
    assert rebuilt.tokenized == ["train"] and _stream(rebuilt) == _expected_stream(DOCS)
    (entry / "meta.json").write_text("{not json")
    with pytest.raises(UserError, match="damaged"):
        open_entry(entry)


def test_a_failed_rebuild_keeps_the_prepared_entry_and_leaves_no_temporary(tmp_path: Path, monkeypatch):
    _write("jsonl", tmp_path, DOCS)
    cfg = _config(tmp_path, {"train_files": ["a.jsonl"]})
    entry = prepare_data(cfg).train.directory
    before = {p.name: p.read_bytes() for p in entry.iterdir()}

    def crash(self, texts):
        raise KeyboardInterrupt  # killed mid-way

    monkeypatch.setattr(ByteTokenizer, "encode_batch", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, force=True)
    assert {p.name: p.read_bytes() for p in entry.iterdir()} == before
    assert sorted(p.name for p in entry.parent.iterdir()) == [f".failed-{entry.name}", entry.name]  # no .tmp-*, .old-*
    # Ranks waiting for the entry in the same attempt learn of the failure instead of waiting forever.
    with pytest.raises(UserError, match="KeyboardInterrupt"):
        _wait_for(entry.parent / "not-there", "key", [], entry.parent / f".failed-{entry.name}", poll_s=0.01)
    monkeypatch.undo()
    prepare_data(cfg, force=True)
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]  # a success clears the marker


def test_ranks_that_must_not_build_wait_for_the_entry(tmp_path: Path):
    _write("jsonl", tmp_path, DOCS)
    cfg = _config(tmp_path, {"train_files": ["a.jsonl"]})
    got = {}
    waiter = threading.Thread(target=lambda: got.setdefault("p", prepare_data(cfg, may_build=False)))
    waiter.start()
    time.sleep(1.5)
    assert waiter.is_alive()  # nothing built yet: it waits
    prepare_data(cfg)
    waiter.join(timeout=10)
    assert not waiter.is_alive() and _stream(got["p"]) == _expected_stream(DOCS)


# --- bad input ------------------------------------------------------------------------------------


def test_wrong_text_field_names_the_file_the_field_and_the_columns(tmp_path: Path):
    (tmp_path / "docs.jsonl").write_text(json.dumps({"body": "no text field here"}) + "\n")
    with pytest.raises(UserError) as err:
        prepare_data(_config(tmp_path, {"train_files": ["docs.jsonl"]}))
    text = str(err.value)
    assert "docs.jsonl" in text and "'text'" in text and "body" in text and "data.text_field" in text
    (tmp_path / "n.csv").write_text("text,id\n1,2\n3,4\n")
    with pytest.raises(UserError, match="not text") as err:
        prepare_data(_config(tmp_path, {"train_files": ["n.csv"]}))
    assert "n.csv" in str(err.value)
    with pytest.raises(UserError, match="has no field 'question'"):
        prepare_data(_config(tmp_path, {"train_files": ["docs.jsonl"], "template": "{question} {body}"}))


def test_malformed_file_is_named_among_several(tmp_path: Path):
    (tmp_path / "good.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{bad json\n')
    with pytest.raises(UserError) as err:
        prepare_data(_config(tmp_path, {"train_files": ["good.jsonl", "bad.jsonl"]}))
    assert "bad.jsonl" in err.value.headline and "good.jsonl" not in err.value.headline


def test_build_data_errors(tmp_path: Path):
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(UserError, match="not enough training data") as err:
        build_data(_plan(_config(tmp_path, {"train_files": ["short.txt"]}, seq_len=32)), tmp_path, 0, 1)
    assert "short.txt" in str(err.value) and "data.train_files[0]" in str(err.value)
    (tmp_path / "blank.txt").write_text("\n\n  \n\n")
    with pytest.raises(UserError, match="training data is empty") as err:
        build_data(_plan(_config(tmp_path, {"train_files": ["blank.txt"]})), tmp_path, 0, 1)
    assert "blank.txt" in str(err.value) and "'text'" in str(err.value)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match="empty.jsonl is empty"):
        build_data(_plan(_config(tmp_path, {"train_files": ["empty.jsonl"]})), tmp_path, 0, 1)
    with pytest.raises(UserError, match="does not exist"):
        build_data(_plan(_config(tmp_path, {"train_files": ["missing.parquet"]})), tmp_path, 0, 1)
    with pytest.raises(UserError, match="no training files given"):
        build_data(_plan(_config(tmp_path, {})), tmp_path, 0, 1)
    with pytest.raises(UserError, match="64 positions"):  # TINY_GPT2 has n_positions 64
        build_data(_plan(_config(tmp_path, {"generate_demo_corpus": True}, seq_len=65)), tmp_path, 0, 1)


def test_check_data_config_reports_every_problem(tmp_path: Path):
    (tmp_path / "notes.docx").write_text("a,b")
    cfg = config_from_dict({"model": {"architecture": dict(TINY_GPT2)},
                            "train": {"seq_len": 128, "global_batch_size": 4},
                            "data": {"train_files": ["missing.txt", "notes.docx", "none/*.jsonl"],
                                     "template": "{unclosed"}}, tmp_path)
    with pytest.raises(UserError) as err:
        check_data_config(cfg, max_positions=64, vocab_size=100)
    wheres = [p.where for p in err.value.problems]
    assert wheres == ["data.train_files[0]", "data.train_files[1]", "data.train_files[2]", "train.seq_len",
                      "data.tokenizer", "data.template"]
    assert "64 positions" in str(err.value) and "notes.docx" in str(err.value)


def test_schema_rejects_two_sources():
    with pytest.raises(UserError, match="not both"):
        config_from_dict({"model": {"architecture": dict(TINY_GPT2)}, "train": {"seq_len": 8, "global_batch_size": 1},
                          "data": {"train_files": ["a.txt"], "dataset": "wikitext"}})


# --- tokenizer training and the CLI ----------------------------------------------------------------


def test_tokenizer_train_makes_a_byte_level_bpe_the_pipeline_uses(tmp_path: Path):
    from orchestrate.data.tokenizer_train import train_tokenizer

    cfg = _config(tmp_path, {"generate_demo_corpus": True})
    out, size = train_tokenizer(cfg, 400, tmp_path / "tok", progress=False)
    tok = HFTokenizer(out)
    assert tok.vocab_size == size <= 400 and size > 300
    text = "The clever fox visits Grüße 世界."  # bytes never seen in the corpus still encode
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("The farmer follows the dog.")) < len("The farmer follows the dog.") / 2
    cfg = _config(tmp_path, {"generate_demo_corpus": True, "tokenizer": "tok"})
    prepared = prepare_data(cfg)
    assert prepared.train.meta["eos_id"] == tok.eos_id and int(prepared.train.tokens.max()) < size
    with pytest.raises(UserError, match="not empty"):
        train_tokenizer(cfg, 400, out, progress=False)


def test_cli_prepare_then_cache_hit(tmp_path: Path, monkeypatch):
    from click.testing import CliRunner

    monkeypatch.chdir(tmp_path)  # the cache goes to ./runs/data_cache of the working directory

    from orchestrate.cli import cli

    _write("parquet", tmp_path, DOCS * 20)
    (tmp_path / "model.yaml").write_text(json.dumps({
        "model": {"architecture": dict(TINY_GPT2)}, "train": {"seq_len": 16, "global_batch_size": 4},
        "data": {"train_files": ["a.parquet"]}}))
    runner = CliRunner()
    first = runner.invoke(cli, ["prepare", str(tmp_path / "model.yaml")])
    assert first.exit_code == 0, first.output
    assert "tokenised train" in first.output and "blocks of 16" in first.output
    second = runner.invoke(cli, ["prepare", str(tmp_path / "model.yaml"), "--set", "train.seq_len=32"])
    assert second.exit_code == 0 and "cache hit" in second.output and "blocks of 32" in second.output
    bad = runner.invoke(cli, ["prepare", str(tmp_path / "model.yaml"), "--set", "data.text_field=body"])
    assert bad.exit_code == 2 and "a.parquet" in bad.output and "'body'" in bad.output


def test_a_dataset_name_is_passed_to_load_dataset_unchanged(tmp_path: Path):
    # A local directory in the Hub's layout stands in for a Hub name (no network here): load_dataset
    # finds the splits by file name, exactly as it would after downloading.
    (tmp_path / "hub_like" / "data").mkdir(parents=True)
    (tmp_path / "hub_like" / "data" / "train.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    (tmp_path / "hub_like" / "data" / "validation.jsonl").write_text(json.dumps({"text": "held out"}) + "\n")
    cfg = _config(tmp_path, {"dataset": "hub_like", "validation_split": "validation"})
    prepared = prepare_data(cfg)
    assert _stream(prepared) == _expected_stream(DOCS)
    assert prepared.validation.tokens.tolist() == _expected_stream(["held out"])
    with pytest.raises(UserError, match="cannot read") as err:
        prepare_data(_config(tmp_path, {"dataset": "hub_like", "split": "test"}))
    assert "data.dataset" in str(err.value)
