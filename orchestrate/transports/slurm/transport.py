"""Transport: inside a SLURM allocation (an salloc shell, a batch script), `srun` starts one
torchrun per allocated node, rendezvous on the first node. Returns when every node has finished."""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.errors import Problem, UserError
from orchestrate.hardware.flags import HardwareFlags
from orchestrate.launch.session import Prepared, describe, env_prefix
from orchestrate.planner.plan import Plan
from orchestrate.transports.slurm import cluster as slurm_cluster
from orchestrate.transports.slurm.cluster import SlurmAllocation
from orchestrate.transports.slurm.submit import STOP_MARGIN_S, SlurmOptions, slurm_job_for_plan

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from orchestrate.config.schema import RunConfig


def hardware_for_allocation(flags: HardwareFlags, alloc: SlurmAllocation) -> HardwareFlags:
    """The hardware flags with the allocation's node count, and its GPUs per node when the flags
    do not say (`gpus_on_node`: SLURM_GPUS_ON_NODE or SLURM_GPUS_PER_NODE)."""
    if flags.nodes is not None and flags.nodes != alloc.nnodes:
        raise UserError("--nodes contradicts the SLURM allocation", [Problem(
            "--nodes", f"{flags.nodes} given, the allocation (job {alloc.job_id}) has {alloc.nnodes} node(s)",
            "leave --nodes out inside an allocation, or allocate that many nodes")])
    update: dict = {"nodes": alloc.nnodes}
    if flags.gpus is None and flags.gpus_per_node is None and alloc.gpus_on_node:
        update["gpus_per_node"] = alloc.gpus_on_node
    return dataclasses.replace(flags, **update)


def allocation_to_use(env: Mapping[str, str] | None = None, *, explicit_rendezvous: bool = False
                      ) -> SlurmAllocation | None:
    """The SLURM allocation `orchestrate launch` spreads its nodes over, or None to launch here:
    outside SLURM, when the user gave a rendezvous (a hand-made multi-node launch), and inside a job
    step (`srun --pty bash`: already on a compute node, and another srun would nest steps)."""
    alloc = slurm_cluster.detect_slurm_allocation(env)
    if alloc is None or explicit_rendezvous or alloc.in_step:
        return None
    return alloc


@dataclass
class SrunInAllocation:
    remote_workers = True  # srun starts them on the nodes
    alloc: SlurmAllocation
    python: str = sys.executable
    name: str = "orchestrate"
    """The job name's source (the config file's stem)."""
    _argv: list[str] = field(default_factory=list, init=False, repr=False)
    _env: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    def hardware(self, flags: HardwareFlags) -> HardwareFlags:
        return hardware_for_allocation(flags, self.alloc)

    def intro(self) -> list[str]:
        return [f"SLURM job {self.alloc.job_id}: launching on its {self.alloc.nnodes} node(s) with srun"]

    def check(self, plan: Plan) -> None:
        pass  # the nodes have the devices, not this shell

    def warm_up(self, config: RunConfig) -> AbstractContextManager:
        return nullcontext()  # the workers start on other machines

    def prepare(self, plan: Plan, run_dir: Path, env: dict[str, str], max_restarts: int,
                dry_run: bool) -> Prepared:
        # All of each node's allocated CPUs go to its one task (torchrun and its workers).
        options = SlurmOptions(python=self.python, cpus_per_task=self.alloc.cpus_on_node)
        job = slurm_job_for_plan(plan, run_dir, options, max_restarts, self.name)
        self._argv, self._env = slurm_cluster.srun_argv_in_allocation(job, self.alloc), env
        command = " ".join([env_prefix(env), shlex.join(self._argv)])
        return Prepared(command=command, script=f"cd {shlex.quote(os.getcwd())}\n{command}",
                        script_comment=f"The exact command `orchestrate launch` ran inside SLURM job "
                                       f"{self.alloc.job_id}.",
                        notices=[f"{describe(plan)}; run directory {run_dir}", f"command: {command}"])

    def run(self, plan: Plan, run_dir: Path, say: Callable[[str], None], console: Console | None) -> int:
        return _run_srun(self._argv, self._env, plan.config.train.preemption_grace_s + STOP_MARGIN_S, say)


def _run_srun(argv: list[str], env: dict[str, str], stop_grace_s: float, say: Callable[[str], None]) -> int:
    """Run srun (the user's own environment wins over `env`). Ctrl-C sends it SIGTERM, which it
    forwards to every node's torchrun (a single SIGINT only makes srun print the tasks' states)."""
    proc = subprocess.Popen(argv, env={**env, **os.environ})
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        say("interrupted: stopping the workers on every node")
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=stop_grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 130
    if code:
        say(f"srun exited with code {code} (a node's torchrun failed or stopped; "
                                "srun stops the others)")
    return code
