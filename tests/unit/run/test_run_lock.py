"""The run directory's lock: one launch at a time per run directory, on every
transport; the holder is named; a dead holder's lock is free; workers refuse a foreign launch's
run directory; a refused launch or resume leaves the run untouched."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrate import api
from orchestrate.config.load import load_config
from orchestrate.errors import UserError
from orchestrate.run import lock as run_lock
from orchestrate.run.layout import LOCK_FILE
from orchestrate.run.lock import RunLock, check_worker_may_run, foreign_holder, read_holder
from tests.helpers.plans import cpu_hardware

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny-gpt2.yaml"


def _dry_run(tmp_path: Path, run_dir: Path, **kwargs):
    config = load_config(TINY, [f"train.output_dir={tmp_path / 'runs'}"])
    return api.launch(api.launch_request(config, cpu_hardware(2), name="tiny-gpt2", run_dir=run_dir,
                                         dry_run=True, **kwargs))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_launch_is_refused_naming_the_holder_and_changes_nothing(tmp_path: Path):
    run_dir = tmp_path / "run"
    _dry_run(tmp_path, run_dir)
    config_before = (run_dir / "config.yaml").read_text()
    with RunLock.acquire(run_dir, "orchestrate first"):
        for resume in (False, True):
            with pytest.raises(UserError) as err:
                _dry_run(tmp_path, run_dir, resume=resume)
            text = str(err.value)
            assert f"pid {os.getpid()}" in text and socket.gethostname() in text and "since" in text, text
        assert (run_dir / "config.yaml").read_text() == config_before
    _dry_run(tmp_path, run_dir)  # released: free again


def test_the_launch_holds_the_lock_until_it_ends_and_then_clears_the_record(tmp_path: Path, monkeypatch):
    from orchestrate.launch import session

    seen = {}
    real_start = session.start

    def start(plan, run_dir, *args, **kwargs):
        seen["holder"] = read_holder(run_dir)
        with pytest.raises(UserError):
            RunLock.acquire(run_dir, "a second launch")
        return real_start(plan, run_dir, *args, **kwargs)

    monkeypatch.setattr(session, "start", start)
    _dry_run(tmp_path, tmp_path / "run")
    assert seen["holder"]["pid"] == os.getpid() and seen["holder"]["remote_workers"] is False
    assert read_holder(tmp_path / "run") is None
    RunLock.acquire(tmp_path / "run", "after").release()


def test_a_killed_holders_lock_is_free(tmp_path: Path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid()}))
    RunLock.acquire(tmp_path, "next").release()


def test_without_flock_the_record_decides_and_a_dead_pid_is_stale(tmp_path: Path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid()}))
    taken = RunLock.acquire(tmp_path, "takes over a stale lock")
    assert read_holder(tmp_path)["pid"] == os.getpid()
    with pytest.raises(UserError, match=f"pid {os.getpid()}"):
        RunLock.acquire(tmp_path, "refused: the holder lives")
    taken.release()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(UserError, match="elsewhere"):
        RunLock.acquire(tmp_path, "refused: cannot tell on another host")


def test_workers_refuse_a_run_directory_locked_by_another_launch(tmp_path: Path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"host": socket.gethostname(), "pid": other.pid, "since": "then", "what": "orchestrate other",
                  "remote_workers": False}
        (tmp_path / LOCK_FILE).write_text(json.dumps(record))
        with pytest.raises(UserError, match=f"pid {other.pid}"):
            check_worker_may_run(tmp_path)
        for accepted in ({"pid": os.getppid()}, {"pid": os.getpid()}, {"remote_workers": True},
                         {"host": "elsewhere"}, {"pid": _dead_pid()}):
            (tmp_path / LOCK_FILE).write_text(json.dumps({**record, **accepted}))
            assert foreign_holder(tmp_path) is None, accepted
    finally:
        other.kill()
        other.wait()


def test_a_refused_resume_leaves_the_run_untouched(tmp_path: Path):
    """A resume the checkpoint cannot continue under is refused before anything is written."""
    import torch

    from orchestrate.planner.plan import RunPlan
    from orchestrate.run.checkpoints import (
        LATEST_FILE,
        CheckpointMeta,
        checkpoint_root,
        rank_file,
        step_dir_name,
        write_meta,
    )

    run_dir = tmp_path / "run"
    _dry_run(tmp_path, run_dir)
    plan = RunPlan.read(run_dir / "plan.json")
    ckpt = checkpoint_root(run_dir) / step_dir_name(2)
    ckpt.mkdir(parents=True)
    write_meta(ckpt, CheckpointMeta.of(plan, 2, 2, {}, torch.__version__))
    for rank in range(2):  # what discovery reads of a checkpoint without a manifest
        rank_file(ckpt, rank).parent.mkdir(exist_ok=True)
        rank_file(ckpt, rank).write_text(json.dumps({"rank": rank, "step": 2}))
    (checkpoint_root(run_dir) / LATEST_FILE).write_text(ckpt.name)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    config = load_config(TINY, [f"train.output_dir={tmp_path / 'runs'}", "train.seq_len=64"])
    with pytest.raises(UserError, match="train.seq_len"):
        api.launch(api.launch_request(config, cpu_hardware(2), name="tiny-gpt2", run_dir=run_dir, resume=True))
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
