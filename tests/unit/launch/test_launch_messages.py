"""What the launcher says when workers fail or it is stopped: the rank that
failed on its own is blamed, its output path is a real path, a stop signal means exit 75."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from orchestrate.run.exits import EX_TEMPFAIL, HOST_OOM_KILLED


def _failure(rank: int, exitcode: int, error_file: str = "<N/A>"):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=error_file)


def _run_with(monkeypatch, tmp_path: Path, exc: BaseException) -> tuple[int, list[str]]:
    import torch.distributed.run as torchrun

    from orchestrate.agent.torchrun import run_torchrun

    def run(args):
        raise exc

    monkeypatch.setattr(torchrun, "run", run)
    said: list[str] = []
    code = run_torchrun(["--nproc-per-node", "2", "-m", "orchestrate.worker", "plan.json"], tmp_path, said.append)
    return code, said


def test_a_rank_killed_by_sigkill_is_blamed_not_the_one_torchrun_terminated(monkeypatch, tmp_path: Path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    failures = {0: _failure(0, -int(signal.SIGTERM)), 1: _failure(1, -int(signal.SIGKILL))}
    code, said = _run_with(monkeypatch, tmp_path, ChildFailedError("orchestrate.worker", failures))
    assert said == [f"worker rank 1 was killed by SIGKILL (kill -9, or the kernel's out-of-memory killer: "
                    f"{HOST_OOM_KILLED}); its output: {tmp_path / 'logs'}"]
    assert "if `dmesg` shows 'Out of memory: Killed process', host memory ran out" in said[0]
    assert "smaller train.micro_batch_size" in said[0] and "train.oom_retries re-plans device" in said[0]
    assert code == 1


def test_a_rank_that_only_lost_its_dead_peer_is_not_blamed(monkeypatch, tmp_path: Path):
    """kill -9 of rank 1: rank 0's next collective fails (gloo: "Connection reset by peer") and it exits
    EX_PEER_LOST. Spawned ranks: torchrun reports both; forked ones: it reports whichever it saw first,
    and the agent's board says who died without a word."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from orchestrate.agent.torchrun import blamed_failure
    from orchestrate.run.exits import EX_PEER_LOST
    from orchestrate.worker import forked

    rank, _ = blamed_failure({0: _failure(0, EX_PEER_LOST), 1: _failure(1, -int(signal.SIGKILL))})
    assert rank == 1
    board = forked.RankBoard(2)  # what the agent shares with the ranks it forks
    monkeypatch.setattr(forked, "BOARD", board)
    board.set(0, forked.RankBoard.PEER_LOST, 0)
    board.set(1, forked.RankBoard.RUNNING, 1)  # never reported back: it was killed
    code, said = _run_with(monkeypatch, tmp_path, ChildFailedError("orchestrate.worker", {0: _failure(0, EX_PEER_LOST)}))
    assert said[0].startswith("worker rank 1 died without an error of its own (killed by a signal") and code == 1
    board.set(1, forked.RankBoard.FAILED, 1)  # it raised: blamed as failed
    code, said = _run_with(monkeypatch, tmp_path, ChildFailedError("orchestrate.worker", {0: _failure(0, EX_PEER_LOST)}))
    assert said[0].startswith("worker rank 1 failed; rank 0 then lost contact with it")


def test_a_stop_signal_after_every_rank_finished_is_exit_0(monkeypatch, tmp_path: Path):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from orchestrate.worker import forked

    board = forked.RankBoard(2)  # what the agent shares with the ranks it forks
    monkeypatch.setattr(forked, "BOARD", board)
    board.set(0, forked.RankBoard.DONE, 0)
    board.set(1, forked.RankBoard.DONE, 1)
    code, said = _run_with(monkeypatch, tmp_path, SignalException("stopped", signal.SIGTERM))
    assert code == 0 and "had finished" in said[0]
    board.set(1, forked.RankBoard.STOPPED, 1)
    code, _ = _run_with(monkeypatch, tmp_path, SignalException("stopped", signal.SIGTERM))
    assert code == EX_TEMPFAIL


def test_a_rank_with_its_own_exit_code_wins_and_its_error_file_folder_is_shown(tmp_path: Path):
    from orchestrate.agent.torchrun import blamed_failure, failure_output

    error_file = tmp_path / "logs" / "attempt_0" / "1" / "error.json"
    error_file.parent.mkdir(parents=True)  # what @record writes (torch.distributed.elastic...errors)
    error_file.write_text('{"message": {"message": "ValueError: x", "extraInfo": {"py_callstack": "", '
                          '"timestamp": "1"}}}')
    failures = {0: _failure(0, -int(signal.SIGKILL)), 1: _failure(1, 3, str(error_file)), 2: _failure(2, -15)}
    rank, failure = blamed_failure(failures)
    assert rank == 1 and failure_output(failure.error_file, tmp_path) == error_file.parent
    assert failure_output("<N/A>", tmp_path) == tmp_path / "logs"


def test_a_stop_signal_is_exit_75_whatever_the_workers_had_done(monkeypatch, tmp_path: Path):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    code, said = _run_with(monkeypatch, tmp_path, SignalException("stopped", signal.SIGTERM))
    assert code == EX_TEMPFAIL and "SIGTERM" in said[0]


@pytest.mark.parametrize("module", ["orchestrate.worker.signals", "orchestrate.worker.orphans"])
def test_the_worker_installs_its_guards_before_torch_is_imported(module: str):
    """So a SIGTERM during the seconds torch takes to import already means "checkpoint and exit"."""
    import subprocess
    import sys

    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip() == "False"


def test_a_stop_signal_before_the_workers_start_is_exit_75(monkeypatch, tmp_path: Path):
    import os

    from orchestrate import api
    from orchestrate.config.load import load_config
    from orchestrate.data import pipeline
    from orchestrate.launch.session import start
    from orchestrate.transports.local.transport import LocalTorchrun
    from tests.helpers.plans import cpu_hardware

    def tokenising(plan, run_dir, methods, progress, **_checks):
        os.kill(os.getpid(), signal.SIGTERM)  # what SLURM or the user sends while the data is tokenised
        return "not reached"

    class NoRun(LocalTorchrun):
        def run(self, *args, **kwargs):
            raise AssertionError("the workers must not start")

    config = load_config(Path(__file__).resolve().parents[3] / "examples" / "tiny-gpt2.yaml",
                         [f"train.output_dir={tmp_path}"])
    written = api.launch(api.launch_request(config, cpu_hardware(2), run_dir=tmp_path / "run", dry_run=True))
    monkeypatch.setattr(pipeline, "prepare_for_plan", tokenising)
    before = signal.getsignal(signal.SIGTERM)
    result = start(written.plan, written.run_dir, NoRun())
    assert result.exit_code == EX_TEMPFAIL and "SIGTERM" in result.messages[-1]
    assert signal.getsignal(signal.SIGTERM) is before  # put back


def test_data_progress_bars_show_on_a_terminal_only(monkeypatch, tmp_path: Path):
    """In a pipe, a CI log or a SLURM output file every redraw of a bar is one more line of noise."""
    import io

    from rich.console import Console

    from orchestrate import api
    from orchestrate.config.load import load_config
    from orchestrate.data import pipeline
    from orchestrate.launch.session import start
    from orchestrate.transports.local.transport import LocalTorchrun
    from tests.helpers.plans import cpu_hardware

    asked = []

    def tokenising(plan, run_dir, methods, progress, **_checks):
        asked.append(progress)
        return "data: tokenised"

    class NoRun(LocalTorchrun):
        def run(self, *args, **kwargs):
            return 0

    config = load_config(Path(__file__).resolve().parents[3] / "examples" / "tiny-gpt2.yaml",
                         [f"train.output_dir={tmp_path}"])
    monkeypatch.setattr(pipeline, "prepare_for_plan", tokenising)
    for name, console in (("pipe", Console(file=io.StringIO())), ("tty", Console(file=io.StringIO(), force_terminal=True))):
        written = api.launch(api.launch_request(config, cpu_hardware(2), run_dir=tmp_path / name, dry_run=True))
        start(written.plan, written.run_dir, NoRun(), console=console)
    assert asked == [False, True]
