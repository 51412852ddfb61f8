"""torchrun's agent process (orchestrate/agent, orchestrate/transports/local/agent.py): the launcher's side
of it without a run, a dead agent, signal forwarding; the agent's own once-only stop; a forked rank's
signals and threads. Every 2-rank launch test runs through the agent as well."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrate.config.load import load_config

ROOT = Path(__file__).resolve().parents[3]


def _config():
    return load_config(ROOT / "examples" / "tiny-gpt2.yaml", [])


def test_an_agent_that_gets_no_run_is_gone_when_closed():
    from orchestrate.transports.local.agent import WarmAgent

    agent = WarmAgent.start(_config())
    assert agent.process.poll() is None  # importing the workers' code meanwhile
    agent.close()
    assert agent.process.returncode is not None


def test_an_agent_that_died_before_the_run_is_reported_with_its_exit_code(tmp_path: Path):
    from orchestrate.transports.local.agent import WarmAgent

    agent = WarmAgent.start(_config())
    agent.process.kill()
    agent.process.wait()
    said: list[str] = []
    code = agent.run(["--nproc-per-node", "1", "-m", "orchestrate.worker", "plan.json"], {}, tmp_path, said.append)
    assert code == 1 and said == ["torchrun's agent process ended with exit code -9 before the workers finished"]
    agent.close()


_COUNTER = """
import signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
print("ready", flush=True)
time.sleep(1.5)
print(len(got), flush=True)
"""


def test_the_launcher_forwards_the_first_of_each_stop_signal_once():
    from orchestrate.transports.local.agent import _Forwarder

    child = subprocess.Popen([sys.executable, "-c", _COUNTER], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    before = signal.getsignal(signal.SIGTERM)
    with _Forwarder(child.pid):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # Python runs the handler between bytecodes of the main thread
    assert signal.getsignal(signal.SIGTERM) is before  # restored on the way out
    assert child.stdout.readline().strip() == "1"
    child.wait()


def test_the_agent_notes_a_stop_before_torchrun_and_raises_once_after(monkeypatch):
    import torch.distributed.elastic.multiprocessing.api as pcontext
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from orchestrate.agent.process import _Stops

    monkeypatch.setattr(pcontext, "_terminate_process_handler", pcontext._terminate_process_handler)
    early = _Stops()
    early.handle(signal.SIGTERM, None)  # while it imports: noted, nothing raised
    early.handle(signal.SIGINT, None)
    assert early.first == signal.SIGTERM
    stops = _Stops()
    stops.arm()
    assert pcontext._terminate_process_handler == stops.handle  # what torchrun installs from now on
    with pytest.raises(SignalException) as raised:
        stops.handle(signal.SIGTERM, None)
    assert raised.value.sigval == signal.SIGTERM
    stops.handle(signal.SIGTERM, None)  # the same job's signal again (direct + forwarded): ignored
    stops.handle(signal.SIGINT, None)


def test_a_forked_rank_gets_default_signals_and_its_thread_count(monkeypatch):
    import torch

    import orchestrate.worker.forked as forked

    seen = {}

    def main(argv):
        seen.update(argv=argv, threads=torch.get_num_threads(), term=signal.getsignal(signal.SIGTERM),
                    intr=signal.getsignal(signal.SIGINT))
        return 75

    from orchestrate.run.exits import STOP_SIGNALS

    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    threads = torch.get_num_threads()
    monkeypatch.setattr(forked, "main", main)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        signal.signal(signal.SIGTERM, lambda s, f: None)  # as torchrun's agent leaves it
        with pytest.raises(SystemExit) as exited:
            forked.run("plan.json")
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        torch.set_num_threads(threads)
    assert exited.value.code == 75  # a non-zero status leaves as SystemExit: torchrun reports it
    assert seen == {"argv": ["plan.json"], "threads": 1, "term": signal.SIG_DFL, "intr": signal.default_int_handler}


def _sleep_as_a_rank(plan: str) -> None:
    time.sleep(300)


@pytest.mark.slow
def test_a_stop_while_torchrun_forks_the_ranks_leaves_no_rank_behind(monkeypatch, tmp_path: Path):
    """The signal lands between the two forks, before torchrun keeps the ranks' process context: the
    rank already forked must not outlive the run (multiprocessing's exit handler would wait for it,
    and the launcher for the agent: a hang)."""
    import multiprocessing
    import socket

    import torch.distributed.elastic.multiprocessing.api as pcontext

    import orchestrate.agent.torchrun as agent_torchrun
    import orchestrate.worker.forked as forked
    from orchestrate.agent.process import _Stops
    from orchestrate.run.exits import EX_TEMPFAIL, STOP_SIGNALS

    monkeypatch.setattr(pcontext, "_terminate_process_handler", pcontext._terminate_process_handler)
    monkeypatch.setattr(forked, "BOARD", None)
    monkeypatch.setattr(agent_torchrun, "run_worker", _sleep_as_a_rank)
    start = multiprocessing.process.BaseProcess.start

    def start_then_stop(process) -> None:
        start(process)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's forwarded stop, before the next fork

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start_then_stop)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--local-addr", "127.0.0.1", "--max-restarts", "0",
            "--log-dir", str(tmp_path / "logs"), "-m", "orchestrate.worker", str(tmp_path / "plan.json")]
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    said: list[str] = []
    try:
        stops = _Stops()
        stops.install()
        stops.arm()
        code = agent_torchrun.run_torchrun(argv, tmp_path, said.append, fork_worker=True)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        left = multiprocessing.active_children()
        for process in left:
            process.kill()
    assert code == EX_TEMPFAIL and said[0].startswith("stopped by signal SIGTERM"), said
    assert not left, left


def _forked_rank(agent_pid: int) -> None:
    import orchestrate.worker.forked as forked

    forked.BOARD = forked.RankBoard(1)
    forked.BOARD.agent_pid = agent_pid
    forked.main = lambda argv: 0
    forked.run("plan.json")


@pytest.mark.parametrize("expected", ["its parent", "another process"])
def test_a_forked_rank_whose_agent_is_gone_is_killed_at_once(expected: str):
    """A forked rank checks for the agent's pid, not for whichever parent it has by then: after the
    agent's death that would be init, and the rank would run on unguarded."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(
        target=_forked_rank, args=(os.getpid() if expected == "its parent" else 1,))
    child.start()
    child.join(timeout=30)
    assert child.exitcode == (0 if expected == "its parent" else -signal.SIGKILL)


def test_every_module_the_agent_imports_for_the_workers_exists():
    import importlib

    from orchestrate.worker.forked import WORKER_MODULES

    for name in WORKER_MODULES:
        importlib.import_module(name)


@pytest.mark.gpu
def test_on_a_gpu_the_forked_ranks_train_on_cuda(tmp_path: Path):
    """The agent never touches CUDA before it forks (orchestrate/agent/process.py): a forked rank
    initialises CUDA itself and trains. One GPU, the demo, DDP, through the default local launch."""
    import json

    from orchestrate import api
    from orchestrate.hardware.resolve import resolve_hardware

    config = load_config(ROOT / "examples" / "tiny-gpt2.yaml", [
        "train.max_steps=3", "train.eval_every=0", "strategy.backend=ddp", "strategy.zero_stage=0",
        f"train.output_dir={tmp_path}"])
    result = api.launch(api.launch_request(config, resolve_hardware(gpus=1), name="gpu-fork", run_dir=tmp_path / "run"))
    assert result.exit_code == 0, result.messages
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["gpu_max_allocated_bytes"] > 0
