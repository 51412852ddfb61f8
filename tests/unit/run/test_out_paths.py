"""Every `--out` refuses to replace files it did not write, as `config --out` and `export --out` do:
`profile --out FILE`, `plan --out DIR` (over a user's plan.json, or into a run that has
checkpoints), `report --out DIR` (over a user's summary.md or loss.png); each accepts a new path
and its own earlier output. An `--out` that cannot be written, and `report` on a run directory
that cannot be written, are one message naming the path (exit 2), not a traceback."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from tests.helpers.cli import assert_one_message, invoke
from tests.helpers.fake_runs import fake_run

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny-gpt2.yaml"


# --- never over files the command did not write -----------------------------------------------


def test_profile_out_refuses_a_users_file_and_replaces_its_own(tmp_path: Path):
    mine = tmp_path / "hw.yaml"
    mine.write_text("my notes\n")
    refused = invoke("profile", "--profile", "rtx3070", "--out", mine)
    assert_one_message(refused, mine, "--out")
    assert mine.read_text() == "my notes\n"
    fresh = tmp_path / "new.yaml"
    assert invoke("profile", "--profile", "rtx3070", "--out", fresh).exit_code == 0
    again = invoke("profile", "--profile", "rtx3070", "--gpus", "2", "--out", fresh)  # its own file
    assert again.exit_code == 0, again.output
    assert "gpus_per_node: 2" in fresh.read_text()
    assert invoke("plan", TINY, "--profile", fresh).exit_code == 0  # still a profile file


def test_plan_out_refuses_a_users_plan_json_and_a_run_with_checkpoints(tmp_path: Path):
    users = tmp_path / "mine"
    users.mkdir()
    (users / "plan.json").write_text('{"mine": 1}')
    assert_one_message(invoke("plan", "--gpus", 2, TINY, "--out", users), "plan.json", "--out NEW")
    assert (users / "plan.json").read_text() == '{"mine": 1}'

    run = fake_run(tmp_path / "run")
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    before = (run / "plan.json").read_bytes()
    assert_one_message(invoke("plan", "--gpus", 2, TINY, "--out", run), "step-00000002", "--out NEW")
    assert (run / "plan.json").read_bytes() == before

    fresh = tmp_path / "fresh"
    assert invoke("plan", "--gpus", 2, TINY, "--out", fresh).exit_code == 0
    first = json.loads((fresh / "plan.json").read_text())
    assert invoke("plan", "--gpus", 2, TINY, "--out", fresh, "--set", "train.seq_len=64").exit_code == 0
    assert json.loads((fresh / "plan.json").read_text())["config"]["train"]["seq_len"] == 64 != \
        first["config"]["train"]["seq_len"]


@pytest.mark.parametrize("users_file", ["summary.md", "loss.png"])
def test_report_out_refuses_a_directory_of_user_files(tmp_path: Path, users_file: str):
    run = fake_run(tmp_path / "run")
    out = tmp_path / "docs"
    out.mkdir()
    (out / users_file).write_text("mine\n")
    assert_one_message(invoke("report", run, "--out", out), users_file, "--out NEW")
    assert (out / users_file).read_text() == "mine\n" and sorted(p.name for p in out.iterdir()) == [users_file]


def test_report_rewrites_its_own_output_and_a_runs_report_directory(tmp_path: Path):
    run = fake_run(tmp_path / "run")
    out = tmp_path / "out"
    for _ in range(2):  # the second time over its own files
        result = invoke("report", run, "--out", out)
        assert result.exit_code == 0, result.output
    (run / "report").mkdir()
    (run / "report" / "summary.md").write_text("an older report, before the marker existed\n")
    result = invoke("report", run)  # RUN_DIR/report of an orchestrate run is the report's own place
    assert result.exit_code == 0, result.output
    assert (run / "report" / "summary.md").read_text().startswith("# orchestrate report")


# --- unwritable paths are one message -----------------------------------------------------------


@pytest.mark.parametrize("command", ["plan", "report", "profile", "tokenizer"])
def test_an_out_that_cannot_be_written_is_one_message(tmp_path: Path, command: str):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"  # under a regular file: no one can create it, root included
    args = {"plan": ["plan", "--gpus", 2, TINY, "--out", out],
            "report": ["report", fake_run(tmp_path / "run"), "--out", out],
            "profile": ["profile", "--profile", "rtx3070", "--out", out],
            "tokenizer": ["tokenizer", "train", TINY, "--vocab-size", 300, "--out", out,
                          "--set", f"data.cache_dir={tmp_path / 'cache'}"]}[command]
    assert_one_message(invoke(*args), tmp_path / "file")


def test_report_on_a_read_only_run_is_one_message(tmp_path: Path, monkeypatch):
    """The run's directory refuses writes as a read-only mount does (EROFS; chmod does not stop root)."""
    run = fake_run(tmp_path / "run")
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self == run / "report":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    result = invoke("report", run)
    assert_one_message(result, run / "report", "Read-only file system", "--out")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_report_on_a_run_without_write_permission_is_one_message(tmp_path: Path):
    run = fake_run(tmp_path / "run")
    run.chmod(0o555)
    try:
        assert_one_message(invoke("report", run), run / "report")
    finally:
        run.chmod(0o755)
