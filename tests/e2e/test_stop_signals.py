"""Stop signals through the real CLI on 2 gloo ranks (slow): a terminal that hangs up (SIGHUP, what
an SSH disconnect sends) and SIGQUIT checkpoint, leave REQUEUE and exit 75 as SIGTERM does; a stop
signal after the last step exits 0 at once (not after the grace period, not 75); a rank killed
with kill -9 is the one the launcher blames."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.helpers.plans import TINY_GPT2

pytestmark = pytest.mark.slow

GRACE_S = 15
"""train.preemption_grace_s here: what a stop after the last step used to wait out before exit 75."""


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    """"long": steps enough to be stopped in the middle; "short": 3 steps, to be stopped after them."""
    base = tmp_path_factory.mktemp("signals")
    out = {}
    for name, steps in (("long", 5000), ("short", 3)):
        config = {"model": {"architecture": dict(TINY_GPT2)},
                  "train": {"seq_len": 32, "global_batch_size": 8, "micro_batch_size": 2, "max_steps": steps,
                            "checkpoint_every": 10_000, "eval_every": 0, "preemption_grace_s": GRACE_S,
                            "output_dir": str(base / "runs")},
                  "data": {"generate_demo_corpus": True}, "strategy": {"backend": "ddp"}}
        (base / f"{name}.yaml").write_text(yaml.safe_dump(config))
        out[name] = base / f"{name}.yaml"
    return out


def _command(config: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "orchestrate", "launch", str(config), "--gpus", "2", "--run-dir", str(run_dir)]


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_for_steps(run_dir: Path, alive, steps: int = 5, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _steps_done(run_dir) < steps:
        assert alive(), "the run ended before it could be stopped"
        assert time.monotonic() < deadline, f"no {steps} steps in {timeout} s"
        time.sleep(0.05)


def _kill_all(pid: int) -> None:
    for proc in [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]:
        proc.kill()


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, float]:
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_all(proc.pid)
        pytest.fail(f"the launch did not end within {timeout} s:\n{proc.communicate()[0]}")
    return proc.returncode, out, time.monotonic() - start


def _assert_checkpointed_on(run_dir: Path, signal_name: str) -> None:
    marker = json.loads((run_dir / "REQUEUE").read_text())
    assert marker["signal"] == signal_name and marker["step"] == marker["stopped_at"] >= 5
    assert (run_dir / "checkpoints" / f"step-{marker['step']:08d}" / "manifest.json").is_file()


def test_a_terminal_that_hangs_up_is_a_checkpoint_requeue_and_exit_75(configs, tmp_path: Path):
    """The launcher on a pseudo-terminal whose other end closes, as sshd's does on a disconnect: the
    kernel sends SIGHUP, and every later write to the terminal fails (EIO)."""
    run_dir = tmp_path / "run"
    pid, terminal = pty.fork()
    if pid == 0:  # the child: the launcher, with the pty as its controlling terminal
        os.execv(sys.executable, _command(configs["long"], run_dir))

    def alive() -> bool:
        if select.select([terminal], [], [], 0)[0]:
            os.read(terminal, 1 << 16)  # keep the terminal drained, as a real one is
        return os.waitpid(pid, os.WNOHANG) == (0, 0)

    try:
        _wait_for_steps(run_dir, alive)
    except BaseException:
        _kill_all(pid)
        raise
    os.close(terminal)
    deadline = time.monotonic() + 120
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            _kill_all(pid)
            pytest.fail("the launcher did not end after the hangup")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 75
    _assert_checkpointed_on(run_dir, "SIGHUP")


def test_sigquit_is_a_checkpoint_requeue_and_exit_75(configs, tmp_path: Path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_command(configs["long"], run_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        _wait_for_steps(run_dir, lambda: proc.poll() is None)
    except BaseException:
        _kill_all(proc.pid)
        raise
    proc.send_signal(signal.SIGQUIT)
    code, out, _ = _finish(proc)
    assert code == 75, out
    _assert_checkpointed_on(run_dir, "SIGQUIT")


@pytest.mark.parametrize("held", ["agent", "ranks"])
def test_a_stop_signal_after_the_last_step_exits_0_at_once(configs, tmp_path: Path, held: str):
    """The launcher is SIGTERMed while the run ends. "agent": torchrun's agent is held (SIGSTOP) once
    rank 0 said done, so the ranks wait for it to collect them when the signal comes; "ranks": the
    ranks are held before they save the model, so the agent has begun stopping them when they finish."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_command(configs["short"], run_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    trigger = "done. model" if held == "agent" else "memory verdict"
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if trigger in line:
            break
    else:
        pytest.fail("the run ended without saying " + trigger + ":\n" + "".join(seen))
    family = psutil.Process(proc.pid).children(recursive=True)
    frozen = ([p for p in family if p.ppid() == proc.pid] if held == "agent"
              else [p for p in family if p.name().startswith("orchestrate-r")])
    try:
        for p in frozen:
            p.suspend()
        time.sleep(1.0)  # the ranks that can still move reach the end of the run meanwhile
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
    finally:
        for p in frozen:
            try:
                p.resume()
            except psutil.NoSuchProcess:  # it had ended (a zombie takes SIGSTOP) and was collected
                pass
    code, out, seconds = _finish(proc, timeout=GRACE_S + 60)
    out = "".join(seen) + out
    assert code == 0, out
    assert seconds < GRACE_S / 2, f"{seconds:.1f} s: the ranks waited for the grace period\n{out}"
    assert (run_dir / "model" / "model.safetensors").is_file() and not (run_dir / "REQUEUE").exists()


def test_kill_9_of_rank_1_blames_rank_1(configs, tmp_path: Path):
    """torchrun's agent is held while rank 1 is killed and rank 0 fails on the lost connection, so
    when it looks both have ended, rank 0 with an exit code of its own (the order in which the agent
    had seen them decided the blame before)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_command(configs["long"], run_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        _wait_for_steps(run_dir, lambda: proc.poll() is None)
        family = psutil.Process(proc.pid).children(recursive=True)
        [agent] = [p for p in family if p.ppid() == proc.pid]
        ranks = {p.name(): p for p in family if p.name().startswith("orchestrate-r")}
        agent.suspend()
        ranks["orchestrate-r1"].kill()
        deadline = time.monotonic() + 60
        while ranks["orchestrate-r0"].status() != psutil.STATUS_ZOMBIE:  # ended, not yet collected
            assert time.monotonic() < deadline, "rank 0 did not notice that rank 1 was gone"
            time.sleep(0.05)
        agent.resume()
    except BaseException:
        _kill_all(proc.pid)
        raise
    code, out, _ = _finish(proc)
    assert code not in (0, 75), out
    # torchrun saw rank 1's death first, or rank 0's exit first: then the agent's board tells
    assert ("worker rank 1 was killed by SIGKILL" in out or
            "worker rank 1 died without an error of its own (killed by a signal" in out), out
    assert "worker rank 0 failed" not in out and "Traceback" not in out, out
