"""Transport: torchrun on this machine, the very argument list that launch.sh shows. orchestrate's
own worker runs under torchrun's agent in a process started before planning, which imports the
workers' code meanwhile and forks them (orchestrate.agent.process); a program of the user's (or a
wrapper module around the worker, as a benchmark's) runs through torchrun's own launcher in this process
(`torch.distributed.run.run`)."""

from __future__ import annotations

import dataclasses
import os
import shlex
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.agent.torchrun import run_torchrun
from orchestrate.errors import Problem, UserError
from orchestrate.hardware.flags import HardwareFlags
from orchestrate.launch.session import Prepared, launch_env
from orchestrate.launch.torchrun_args import LaunchOptions, format_command, torchrun_argv
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import LOG_DIR, PLAN_FILE, WORKER_MODULE
from orchestrate.transports.local.agent import WarmAgent
from orchestrate.transports.local.metrics_progress import follow_metrics

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from orchestrate.config.schema import RunConfig


@dataclass
class LocalTorchrun:
    remote_workers = False
    """torchrun runs in this process or its agent child: the workers are its descendants (they check
    the lock by that)."""
    options: LaunchOptions = field(default_factory=LaunchOptions)
    """torchrun's rendezvous and restart options (a hand-made multi-node launch gives them)."""
    _argv: list[str] = field(default_factory=list, init=False, repr=False)
    _agent: WarmAgent | None = field(default=None, init=False, repr=False)

    def hardware(self, flags: HardwareFlags) -> HardwareFlags:
        return flags

    def intro(self) -> list[str]:
        return []

    @contextmanager
    def warm_up(self, config: RunConfig):
        """torchrun's agent from now on, for orchestrate's worker (module docstring); closed at the end
        (killed if no run used it: a refused launch)."""
        if not self._forks_worker():
            yield
            return

        self._agent = WarmAgent.start(config)
        try:
            yield
        finally:
            if self._agent is not None:
                self._agent.close()
            self._agent = None

    def _forks_worker(self) -> bool:
        return not self.options.program and self.options.worker_module == WORKER_MODULE

    def check(self, plan: RunPlan) -> None:
        if not plan.hardware.has_gpu:
            return
        import torch  # only here: a CPU launch never imports torch in the launcher

        if not torch.cuda.is_available():
            raise UserError("this plan is for GPUs but CUDA is not available on this machine", [Problem(
                "hardware", f"planned for {plan.hardware.gpus_per_node} x {plan.hardware.gpu.name}",
                "run it on that machine (`orchestrate config` writes the run directory without starting), "
                "or plan for CPU processes here")])

    def prepare(self, plan: RunPlan, run_dir: Path, env: dict[str, str], max_restarts: int,
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
        notices += plan.run.env_notes if plan.run else []
        notices += [f"strategy {plan.chosen.name}; run directory {run_dir}", f"command: {command}"]
        return Prepared(command=command, script=f"cd {shlex.quote(os.getcwd())}\n{command}",
                        script_comment="The exact command `orchestrate launch` ran for this run.", notices=notices)

    def run(self, plan: RunPlan, run_dir: Path, say: Callable[[str], None], console: Console | None) -> int:
        if not self._forks_worker():
            with _environment(launch_env(plan)), follow_metrics(plan, run_dir, console):
                return run_torchrun(self._argv, run_dir, say)
        # An agent runs torchrun once: `start` without `launch`, or a run again after an out-of-memory
        # re-plan, starts a fresh one.
        with self.warm_up(plan.config) if self._agent is None else nullcontext():
            agent, self._agent = self._agent, None
            try:
                with follow_metrics(plan, run_dir, console):
                    return agent.run(self._argv, launch_env(plan), run_dir, say)
            finally:
                agent.close()


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
