"""A data-cache entry is used only when it is the entry of its key (issue 38, item 3), and a full disk
while one is written is one message with nothing left behind (item 7).

- An entry replaced by a copy of another entry (its meta.json names another key) is a miss: rebuilt,
  with a line saying so, and the rebuilt entry holds this data.
- An entry that is a symbolic link to another one, or holds a linked file, is refused, naming the link.
- ENOSPC while tokenising (simulated: the writer raises it) names the cache directory, removes the
  temporary directory and does not blame the input file.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

from orchestrate.config.load import config_from_dict
from orchestrate.data import prepare
from orchestrate.data.cache import META_FILE, TOKENS_FILE
from orchestrate.data.pipeline import prepare_data
from orchestrate.errors import UserError
from tests.helpers.plans import TINY_GPT2


def _config(tmp_path: Path, name: str):
    return config_from_dict({"model": {"architecture": dict(TINY_GPT2)},
                             "train": {"seq_len": 8, "global_batch_size": 4},
                             "data": {"num_proc": 1, "train_files": [name], "cache_dir": "cache"}}, tmp_path)


def _two_entries(tmp_path: Path):
    (tmp_path / "a.txt").write_text("alpha alpha alpha\n")
    (tmp_path / "b.txt").write_text("a different corpus, bravo\n")
    a, b = _config(tmp_path, "a.txt"), _config(tmp_path, "b.txt")
    return a, b, prepare_data(a).train.directory, prepare_data(b).train.directory


def test_an_entry_replaced_by_a_copy_of_another_is_rebuilt_with_a_line(tmp_path: Path, capsys):
    a, _, entry_a, entry_b = _two_entries(tmp_path)
    shutil.rmtree(entry_a)
    shutil.copytree(entry_b, entry_a)
    capsys.readouterr()
    again = prepare_data(a)
    assert again.tokenized == ["train"]  # a miss, not a hit on b's tokens
    said = capsys.readouterr().err
    assert str(entry_a) in said and "does not belong to these sources" in said and "tokenising again" in said
    assert bytes(again.train.tokens[:5].tolist()) == b"alpha"
    assert json.loads((entry_a / META_FILE).read_text())["key"] != json.loads((entry_b / META_FILE).read_text())["key"]
    assert prepare_data(a).tokenized == []  # the rebuilt entry is a hit again


@pytest.mark.parametrize("what", ["entry", "file"])
def test_a_linked_entry_or_entry_file_is_refused(tmp_path: Path, what: str):
    a, _, entry_a, entry_b = _two_entries(tmp_path)
    link = entry_a if what == "entry" else entry_a / TOKENS_FILE
    if what == "entry":
        shutil.rmtree(entry_a)
        entry_a.symlink_to(entry_b)
    else:
        link.unlink()
        link.symlink_to(entry_b / TOKENS_FILE)
    before = (entry_b / TOKENS_FILE).read_bytes()
    with pytest.raises(UserError) as err:
        prepare_data(a)
    text = str(err.value)
    assert "symbolic link" in text and str(link) in text and f"rm {link}" in text
    assert (entry_b / TOKENS_FILE).read_bytes() == before


def test_a_full_disk_while_tokenising_is_one_message_and_leaves_no_temporary(tmp_path: Path, monkeypatch):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "some text to tokenise"}) + "\n")
    cfg = _config(tmp_path, "a.jsonl")

    build = prepare._build

    def full(sources, spec, tokenizer, work, *args):  # the entry's files written, then the disk is full
        build(sources, spec, tokenizer, work, *args)
        raise OSError(errno.ENOSPC, "No space left on device", str(work / META_FILE))

    monkeypatch.setattr(prepare, "_build", full)
    with pytest.raises(UserError) as err:
        prepare_data(cfg)
    text = str(err.value)
    cache = tmp_path / "cache"
    assert "ran out of space" in text and str(cache) in text and "MiB" in text and "data.cache_dir" in text
    assert "valid json" not in text
    assert [p.name for p in cache.iterdir() if p.name.startswith((".tmp-", ".old-"))] == []


def test_a_full_disk_under_the_input_reader_is_not_blamed_on_the_input(tmp_path: Path, monkeypatch):
    import datasets

    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "some text to tokenise"}) + "\n")

    def full(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            raise RuntimeError("datasets could not write its Arrow copy") from exc

    monkeypatch.setattr(datasets, "load_dataset", full)
    with pytest.raises(UserError) as err:
        prepare_data(_config(tmp_path, "a.jsonl"))
    assert "ran out of space" in str(err.value) and "valid json" not in str(err.value)
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp-")] == []
