"""Starting the workers on Slurm, two ways.

Inside an allocation (an salloc shell, a batch script), `SrunInAllocation` is the transport of
`orchestrate launch`: `srun` starts one torchrun per allocated node, rendezvous on the first node,
and it returns when every node has finished.

`orchestrate slurm` (`prepare_slurm_job`): plan for nodes x ranks per node, write the run directory
and RUN_DIR/job.sbatch (`job.render_sbatch`); `--submit` hands it to sbatch. The job checkpoints and
requeues itself on USR1 (before the time limit, or `scancel -s USR1 -b JOB`) and the requeued job
resumes from the run directory (see `job`'s module docstring).

Shared paths. The run directory is written once, here, and the data tokenised once, here, into
the cache (`data.cache_dir`, default `<train.output_dir>/data_cache`); every node reads plan.json,
the rendered configs and the cache at the same absolute paths and writes its logs, checkpoints and
the trained model into the run directory. So both must be on a filesystem every node mounts at the
same path (NFS, Lustre, a cluster home), and orchestrate must be installed at the same interpreter
path on every node (`python`, default this process's own). Nothing checks this up front: a node that
lacks a path fails at start with "plan file ... not found" or "No such file" in its output."""

from __future__ import annotations

import dataclasses
import os
import re
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
from orchestrate.launch.output_relay import relay_output
from orchestrate.launch.resume import resumed_data
from orchestrate.launch.rundir import default_run_dir, prepare_run_dir
from orchestrate.launch.session import Prepared, describe, env_prefix, launch_env, say, shows_progress
from orchestrate.launch.torchrun_args import worker_torchrun_args
from orchestrate.methods.registry import method_data
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import PLAN_FILE, worker_program
from orchestrate.transports.slurm import cluster as slurm_cluster
from orchestrate.transports.slurm import job as slurm
from orchestrate.transports.slurm.cluster import SlurmAllocation
from orchestrate.transports.slurm.job import SlurmJob

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

    def check(self, plan: RunPlan) -> None:
        pass  # the nodes have the devices, not this shell

    def warm_up(self, config: RunConfig) -> AbstractContextManager:
        return nullcontext()  # the workers start on other machines

    def prepare(self, plan: RunPlan, run_dir: Path, env: dict[str, str], max_restarts: int,
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

    def run(self, plan: RunPlan, run_dir: Path, say: Callable[[str], None], console: Console | None) -> int:
        return _run_srun(self._argv, self._env, plan.config.train.preemption_grace_s + STOP_MARGIN_S, say)


def _run_srun(argv: list[str], env: dict[str, str], stop_grace_s: float, say: Callable[[str], None]) -> int:
    """Run srun (the user's own environment wins over `env`), its output relayed without torchrun's
    prefix after srun's label (`job.without_teed_prefix_after_label`). Ctrl-C sends it SIGTERM, which it
    forwards to every node's torchrun (a single SIGINT only makes srun print the tasks' states)."""
    proc = subprocess.Popen(argv, env={**env, **os.environ}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    relays = relay_output(proc, slurm.without_teed_prefix_after_label)
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
    finally:
        for relay in relays:  # srun's last lines before its exit code is told
            relay.join()
    if code:
        say(f"srun exited with code {code} (a node's torchrun failed or stopped; "
                                "srun stops the others)")
    return code


STOP_MARGIN_S = 15
"""After Ctrl-C or a failed host: how much longer than the workers' checkpoint grace
(`train.preemption_grace_s`) srun or a host may take to stop before it is killed."""


@dataclass(frozen=True)
class SlurmOptions:
    """What `orchestrate slurm` asks Slurm for beyond the plan's nodes and ranks (see SlurmJob)."""

    partition: str | None = None
    time: str | None = None
    account: str | None = None
    mem: str | None = None
    cpus_per_task: int | None = None
    job_name: str | None = None
    """Default: the config file's stem."""
    signal_lead_s: int | None = None
    """Default: the workers' checkpoint grace, `train.preemption_grace_s`."""
    requeue: bool = True
    python: str = sys.executable
    extra_sbatch: tuple[str, ...] = ()


@dataclass
class PreparedJob:
    plan: RunPlan
    run_dir: Path
    script: Path
    job: SlurmJob
    messages: list[str]


def slurm_job_for_plan(plan: RunPlan, run_dir: Path, options: SlurmOptions = SlurmOptions(),
                       max_restarts: int = 0, name: str = "orchestrate") -> SlurmJob:
    """The batch job that runs RUN_DIR/plan.json: a node per plan node, a torchrun on each."""
    hw = plan.hardware
    grace = plan.config.train.preemption_grace_s
    # The script sets torchrun's shutdown timeout itself (from shutdown_grace_s).
    env = {k: v for k, v in launch_env(plan).items() if k != "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
    return SlurmJob(
        run_dir=run_dir, nodes=hw.nodes, procs_per_node=hw.ranks_per_node,
        gpus_per_node=hw.gpus_per_node if hw.has_gpu else 0, cpus_per_task=options.cpus_per_task,
        mem=options.mem, time=options.time, partition=options.partition, account=options.account,
        job_name=options.job_name or re.sub(f"[^{slurm.NAME_CHARS}]", "-", name) or "orchestrate", python=options.python,
        program=worker_program(run_dir / PLAN_FILE), torchrun_args=worker_torchrun_args(run_dir, max_restarts),
        signal_lead_s=grace if options.signal_lead_s is None else options.signal_lead_s, shutdown_grace_s=grace,
        requeue=options.requeue, extra_sbatch=options.extra_sbatch, env=tuple(sorted(env.items())))


def prepare_slurm_job(config: RunConfig, flags: HardwareFlags, *, name: str = "run", run_dir: Path | None = None,
                      options: SlurmOptions = SlurmOptions(), max_restarts: int = 0, resume: bool = False,
                      console: Console | None = None) -> PreparedJob:
    """Plan for `flags` (nodes x GPUs or CPU processes per node), write the run directory, tokenise
    the data into the shared cache and write RUN_DIR/job.sbatch. Nothing is submitted
    (`slurm_cluster.submit(prepared.script)` does that). `resume`: continue the newest run (or `run_dir`)
    from its latest checkpoint, as `orchestrate launch --resume` does."""
    hardware = flags.resolve()
    # Check the job request before writing anything: a bad --time, --partition or run directory
    # path should not leave a run directory behind.
    grace = config.train.preemption_grace_s
    slurm.validate_job(SlurmJob(
        run_dir=(run_dir or default_run_dir(config, name)).absolute(), nodes=hardware.nodes,
        procs_per_node=hardware.ranks_per_node, cpus_per_task=options.cpus_per_task, mem=options.mem,
        time=options.time, partition=options.partition, account=options.account,
        job_name=options.job_name or "orchestrate", python=options.python, shutdown_grace_s=grace,
        signal_lead_s=grace if options.signal_lead_s is None else options.signal_lead_s,
        extra_sbatch=options.extra_sbatch))
    messages: list[str] = []

    def tell(text: str) -> None:
        say(console, messages, text)

    plan, run_dir = prepare_run_dir(config, hardware, name, run_dir, resume, tell)
    from orchestrate.data.pipeline import prepare_for_plan

    tell(prepare_for_plan(plan, run_dir, method_data(plan.config), progress=shows_progress(console),
                          resumed=resumed_data(run_dir)))
    job = slurm_job_for_plan(plan, run_dir, options, max_restarts, name)
    script = slurm_cluster.write_sbatch(job)
    tell(f"{describe(plan)}; run directory {run_dir}")
    if hardware.has_gpu and not flags.profile and hardware.name.startswith("detected:cpu"):
        tell(f"planned for {hardware.gpu.name} GPUs (no GPU here to measure): "
             "pass --profile with your cluster's GPU for an accurate plan")
    tell(f"job script: {script}")
    return PreparedJob(plan, run_dir, script, job, messages)
