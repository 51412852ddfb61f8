"""Transport: torchrun on this machine, through torchrun's own launcher in this process
(`torch.distributed.run.run`, the very argument list that launch.sh shows)."""

from __future__ import annotations

import dataclasses
import os
import shlex
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.errors import Problem, UserError
from orchestrate.hardware.flags import HardwareFlags
from orchestrate.launch.progress_bar import follow_metrics
from orchestrate.launch.session import Prepared, launch_env
from orchestrate.launch.torchrun_args import LaunchOptions, format_command, torchrun_argv
from orchestrate.planner.plan import Plan
from orchestrate.run.exit_codes import EX_TEMPFAIL
from orchestrate.run.layout import LOG_DIR, PLAN_FILE

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console


@dataclass
class LocalTorchrun:
    remote_workers = False
    """torchrun runs in this process: the workers are its children (they check the lock by that)."""
    options: LaunchOptions = field(default_factory=LaunchOptions)
    """torchrun's rendezvous and restart options (a hand-made multi-node launch gives them)."""
    _argv: list[str] = field(default_factory=list, init=False, repr=False)

    def hardware(self, flags: HardwareFlags) -> HardwareFlags:
        return flags

    def intro(self) -> list[str]:
        return []

    def check(self, plan: Plan) -> None:
        import torch

        if plan.hardware.has_gpu and not torch.cuda.is_available():
            raise UserError("this plan is for GPUs but CUDA is not available on this machine", [Problem(
                "hardware", f"planned for {plan.hardware.gpus_per_node} x {plan.hardware.gpu.name}",
                "run it on that machine (`orchestrate config` writes the run directory without starting), "
                "or plan for CPU processes here")])

    def prepare(self, plan: Plan, run_dir: Path, env: dict[str, str], max_restarts: int,
                dry_run: bool) -> Prepared:
        options = dataclasses.replace(self.options, max_restarts=max_restarts)
        # The port is chosen once, here: launch.sh and the run use the same argument list.
        self._argv = torchrun_argv(plan, run_dir / PLAN_FILE, options, run_dir / LOG_DIR)
        command = format_command(self._argv, env)
        notices = []
        if not plan.hardware.has_gpu:
            n = plan.hardware.ranks_per_node
            notices.append(f"No GPU on this machine: running {n} CPU process{'es' if n != 1 else ''} per node "
                           "with the gloo backend (slow; meant for trying things out and tests).")
        notices += [f"NCCL: {note}" for note in (plan.run.env_notes if plan.run else [])]
        notices += [f"strategy {plan.chosen.name}; run directory {run_dir}", f"command: {command}"]
        return Prepared(command=command, script=f"cd {shlex.quote(os.getcwd())}\n{command}",
                        script_comment="The exact command `orchestrate launch` ran for this run.", notices=notices)

    def run(self, plan: Plan, run_dir: Path, say: Callable[[str], None], console: Console | None) -> int:
        with _environment(launch_env(plan)), follow_metrics(plan, run_dir, console):
            return _run_torchrun(self._argv, run_dir, say)


@contextmanager
def _environment(env: dict[str, str]):
    """Add `env` for the workers (torchrun copies os.environ); the user's own values win."""
    added = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def blamed_failure(failures: dict) -> tuple[int, object]:
    """(rank, failure) of the rank that failed first on its own. torchrun SIGTERMs (then SIGKILLs)
    the others once one fails, so a negative SIGTERM exit code is torchrun's doing: prefer a rank
    with its own exit code (> 0), then one killed by another signal (kill -9: -9), and only then
    a SIGTERMed one; earliest first, then the lowest rank."""
    import signal

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


def _run_torchrun(argv: list[str], run_dir: Path, say: Callable[[str], None]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = blamed_failure(exc.failures)
        say(f"worker rank {rank} failed with exit code {failure.exitcode}; its output: "
            f"{failure_output(failure.error_file, run_dir)}")
        return failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
    except SignalException as exc:  # torchrun turns SIGINT/SIGTERM into this after stopping the workers
        # A stop signal at any point (even before step 1) means: checkpoint if possible, requeue.
        say(f"stopped by signal {exc.sigval.name}; resume from the latest checkpoint (or step 0) of {run_dir}")
        return EX_TEMPFAIL
    return 0
