"""torchrun in this process: its exit code, and what to tell the user about a failed rank or a stop
signal. The launcher runs it here for a program of the user's (orchestrate.transports.local.transport); torchrun's
agent process (orchestrate.agent.process) runs it for orchestrate's worker, forking the ranks."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from pathlib import Path

from orchestrate.run.exits import EX_OUT_OF_MEMORY, EX_PEER_LOST, EX_TEMPFAIL, HOST_OOM_KILLED
from orchestrate.run.layout import LOG_DIR, OOM_DIR, WORKER_MODULE, read_oom_records
from orchestrate.worker import forked
from orchestrate.worker.forked import RankBoard, share_board
from orchestrate.worker.forked import run as run_worker


def blamed_failure(failures: dict) -> tuple[int, object]:
    """(rank, failure) of the rank that failed first on its own. torchrun SIGTERMs (then SIGKILLs)
    the others once one fails, so a negative SIGTERM exit code is torchrun's doing, and a rank that
    lost contact with a dead peer (EX_PEER_LOST) is that peer's victim: prefer a rank with its own
    exit code (> 0), then one killed by another signal (kill -9: -9), then a peer's victim, and only
    then a SIGTERMed one; earliest first, then the lowest rank."""

    def own(failure) -> int:
        code = failure.exitcode or 0
        if code == EX_PEER_LOST:
            return 2
        return 0 if code > 0 else 1 if code != -int(signal.SIGTERM) else 3

    return min(failures.items(), key=lambda kv: (own(kv[1]), kv[1].timestamp, kv[0]))


def _failure_told(rank: int, failure, run_dir: Path) -> tuple[str, int]:
    """The launcher's line on a failed group and its exit code. A reported rank that only lost
    contact with a dead peer (EX_PEER_LOST) is not the one to blame: the board of forked ranks
    (worker/forked.py) names the rank that failed on its own, or the one that died without a word."""
    code = failure.exitcode
    if forked.BOARD is not None and code == EX_PEER_LOST:
        own, silent = forked.BOARD.ranks_in(RankBoard.FAILED), forked.BOARD.ranks_in(RankBoard.RUNNING)
        if own or silent:
            what = "failed" if own else ("died without an error of its own (killed by a signal: kill -9, or the "
                                         f"kernel's out-of-memory killer: {HOST_OOM_KILLED})")
            return (f"worker rank {(own or silent)[0]} {what}; rank {rank} then lost contact with it; the ranks' "
                    f"output: {run_dir / LOG_DIR}"), 1
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        how = f"was killed by {name}" + (f" (kill -9, or the kernel's out-of-memory killer: {HOST_OOM_KILLED})"
                                         if -code == signal.SIGKILL else "")
    elif code == EX_OUT_OF_MEMORY:
        memory = "host" if any(r.get("memory") == "host" for r in read_oom_records(run_dir)) else "device"
        how = f"ran out of {memory} memory (exit {code}; its record: {run_dir / OOM_DIR})"
    else:
        how = f"failed with exit code {code}"
    return f"worker rank {rank} {how}; its output: {failure_output(failure.error_file, run_dir)}", \
        code if code and code > 0 and code != EX_PEER_LOST else 1


def failure_output(error_file: str | None, run_dir: Path) -> Path:
    """Where a failed rank's output is: its error file's folder, or the logs folder when it left no
    error file (torchrun then reports the placeholder "<N/A>")."""
    if error_file and os.path.isabs(error_file):
        return Path(error_file).parent
    return run_dir / LOG_DIR


def run_torchrun(argv: list[str], run_dir: Path, say: Callable[[str], None], fork_worker: bool = False) -> int:
    """torchrun with `argv`, here; its exit code, with a failure or stop told through `say`.
    `fork_worker` (torchrun's agent process, orchestrate.agent.process): the program of argv is the
    worker, `-m orchestrate.worker PLAN`; it runs as orchestrate.worker.forked.run(PLAN) in ranks forked
    from this process (torchrun's start_method="fork"), not in fresh interpreters."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        if fork_worker:
            _run_forked(parse_args(argv))
        else:
            run(parse_args(argv))
    except ChildFailedError as exc:
        told, code = _failure_told(*blamed_failure(exc.failures), run_dir)
        say(told)
        return code
    except SignalException as exc:  # torchrun turns SIGINT/SIGTERM into this after stopping the workers
        if forked.BOARD is not None and forked.BOARD.all_done:  # the signal came after the last step: nothing to resume
            say(f"the run had finished when {exc.sigval.name} came: nothing to resume ({run_dir})")
            return 0
        # A stop signal at any point (even before step 1) means: checkpoint if possible, requeue.
        say(stopped(exc.sigval, run_dir))
        return EX_TEMPFAIL
    return 0


def stopped(sig: signal.Signals, run_dir: Path) -> str:
    return f"stopped by signal {sig.name}; resume from the latest checkpoint (or step 0) of {run_dir}"


def _run_forked(args) -> None:
    """What torch.distributed.run.run(args) does for our argv (a c10d or static rendezvous, never
    --standalone), with the worker as a function in forked ranks."""
    import torch.multiprocessing
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    if not (args.module and args.training_script == WORKER_MODULE and len(args.training_script_args) == 1):
        # LocalTorchrun sends only its own worker here (_forks_worker); anything else runs in the launcher.
        raise ValueError(f"the agent forks `-m {WORKER_MODULE} PLAN` only, not {args.training_script!r}")
    torch.multiprocessing._set_thread_name("pt_elastic")
    if args.master_port is None:  # torch.distributed.run.run's default
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    share_board(config.nproc_per_node)
    _quiet_told_exits()
    try:
        elastic_launch(config=config, entrypoint=run_worker)(args.training_script_args[0])
    finally:
        _kill_untracked_ranks()


def _kill_untracked_ranks() -> None:
    """Ranks forked by torchrun that it lost track of: a stop signal while torchrun forks the ranks
    raises before LocalElasticAgent keeps their process context (`self._pcontext = start_processes(...)`),
    so its shutdown closes nothing, and multiprocessing's exit handler would then wait for these
    non-daemonic ranks, which never got the signal: the agent, and the launcher with it, hang
    (docs/measurements.md#agenttorchrunpy). Still starting, they have no step to checkpoint. After
    a normal end torchrun has joined every rank and there is none."""
    for rank in multiprocessing.active_children():
        rank.kill()
        rank.join()


class _ExitTold(logging.Filter):
    """Drops torchrun's traceback of a forked rank that exited (ProcessExitedException: "process 1
    terminated with exit code 2" or "with signal SIGKILL"): its own frames only, and the launcher's
    line (`_failure_told`) says which rank, with what code or signal, where its output is; a rank
    with a code of its own printed why (a UserError, a stop, a lost peer). A rank that raised keeps
    its traceback (ProcessRaisedException): that one is the only account of what went wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        from torch.multiprocessing.spawn import ProcessExitedException

        return not (record.exc_info and isinstance(record.exc_info[1], ProcessExitedException))


def _quiet_told_exits() -> None:
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_ExitTold())
