"""torchrun in this process: its exit code, and what to tell the user about a failed rank or a stop
signal. The launcher runs it here for a program of the user's (orchestrate.transports.local.transport); torchrun's
agent process (orchestrate.agent.process) runs it for orchestrate's worker, forking the ranks."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

from orchestrate.run.exits import EX_TEMPFAIL
from orchestrate.run.layout import LOG_DIR, WORKER_MODULE


def blamed_failure(failures: dict) -> tuple[int, object]:
    """(rank, failure) of the rank that failed first on its own. torchrun SIGTERMs (then SIGKILLs)
    the others once one fails, so a negative SIGTERM exit code is torchrun's doing: prefer a rank
    with its own exit code (> 0), then one killed by another signal (kill -9: -9), and only then
    a SIGTERMed one; earliest first, then the lowest rank."""

    def own(failure) -> int:
        code = failure.exitcode or 0
        return 0 if code > 0 else 1 if code != -int(signal.SIGTERM) else 2

    return min(failures.items(), key=lambda kv: (own(kv[1]), kv[1].timestamp, kv[0]))


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
        rank, failure = blamed_failure(exc.failures)
        say(f"worker rank {rank} failed with exit code {failure.exitcode}; its output: "
            f"{failure_output(failure.error_file, run_dir)}")
        return failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
    except SignalException as exc:  # torchrun turns SIGINT/SIGTERM into this after stopping the workers
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

    from orchestrate.worker.forked import run as run_worker

    if not (args.module and args.training_script == WORKER_MODULE and len(args.training_script_args) == 1):
        # LocalTorchrun sends only its own worker here (_forks_worker); anything else runs in the launcher.
        raise ValueError(f"the agent forks `-m {WORKER_MODULE} PLAN` only, not {args.training_script!r}")
    torch.multiprocessing._set_thread_name("pt_elastic")
    if args.master_port is None:  # torch.distributed.run.run's default
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=run_worker)(args.training_script_args[0])
