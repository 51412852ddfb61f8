"""Workers never outlive their launcher: SIGKILL of a real `orchestrate launch` leaves
no worker behind (orchestrate.worker.orphans); SIGTERM before step 1 is a checkpoint and exit 75
like any other stop signal. Slow: 2 gloo ranks of the tiny demo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-gpt2.yaml"


def _workers(launcher_pid: int) -> list:
    """The launcher's descendants that are ranks with their stop handler in: named `orchestrate-r<RANK>`
    (worker.main.name_this_rank; forked by torchrun's agent process, they have its command line)."""
    import psutil

    found = []
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if child.name().startswith("orchestrate-r"):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def _launch(run_dir: Path, output=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrate", "launch", str(TINY), "--gpus", "2", "--run-dir", str(run_dir),
         "--set", f"train.output_dir={run_dir.parent}", "--set", "train.max_steps=100000",
         "--set", "train.seq_len=32", "--set", "train.global_batch_size=4", "--set", "train.eval_every=0"],
        cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, text=True)


def _sigterm_when(run_dir: Path, ready, settle_s: float = 0.0) -> tuple[int, str]:
    """Launch, wait until `ready(launcher)`, check that step 1 has not ended, SIGTERM the launcher;
    its exit code and output."""
    proc = _launch(run_dir, subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not ready(proc):
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.01)
        time.sleep(settle_s)
        assert not (run_dir / "metrics.jsonl").exists(), "too late: step 1 is done"
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out


@pytest.mark.slow
def test_sigterm_before_step_1_checkpoints_and_exits_75(tmp_path: Path):
    run_dir = tmp_path / "run"
    code, out = _sigterm_when(run_dir, lambda proc: len(_workers(proc.pid)) == 2)
    assert code == 75, out
    assert (run_dir / "REQUEUE").is_file() and (run_dir / "checkpoints" / "latest").is_file(), out


@pytest.mark.slow
def test_sigkill_of_the_launcher_ends_every_worker_within_10_s(tmp_path: Path):
    import psutil

    run_dir = tmp_path / "run"
    proc = _launch(run_dir)
    workers = []
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, "the launch ended before it could be killed"
            time.sleep(0.2)
        assert json.loads(metrics.read_text().splitlines()[0])["step"] >= 1
        workers = _workers(proc.pid)
        assert len(workers) == 2, workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers outlived the launcher by 10 s: {[p.pid for p in alive]}"
    finally:
        for p in workers:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_sigterm_while_the_agent_imports_is_exit_75_without_workers(tmp_path: Path):
    """torchrun's agent process imports for seconds after the launcher is ready (orchestrate/agent):
    a stop signal then means requeue (75), as anywhere before step 1, and no worker starts.
    0.2 s after launch.sh: the cached data is mapped in milliseconds, the agent needs seconds more."""
    run_dir = tmp_path / "run"
    code, out = _sigterm_when(run_dir, lambda proc: (run_dir / "launch.sh").exists() and not _workers(proc.pid), 0.2)
    assert code == 75, out
    assert "stopped by" in out and not list((run_dir / "logs").rglob("stdout.log")), out
