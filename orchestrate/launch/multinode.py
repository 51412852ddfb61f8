"""Beyond one machine: one plan for the whole job, one run directory, one torchrun per node.

Three ways in, each planning for nodes x ranks per node (the planner weighs the inter-node link,
e.g. FSDP hybrid shard against full sharding across nodes):

- `orchestrate slurm` -> `prepare_slurm_job`: plan, write the run directory and RUN_DIR/job.sbatch
  (`slurm.render_sbatch`); `--submit` hands it to sbatch. The job checkpoints and requeues itself on
  USR1 (before the time limit, or `scancel -s USR1 -b JOB`) and the requeued job resumes from the
  run directory (see `slurm`'s module docstring).
- `orchestrate launch` inside a SLURM allocation (an salloc shell, a batch script) ->
  `launch_in_allocation`: `srun`, one torchrun per allocated node, rendezvous on the first node.
- `orchestrate launch --hosts HOSTFILE` -> `launch_over_ssh`: torchrun on every host over SSH
  (`ssh.run_commands`), rendezvous on the first host; one host failing stops all.

Shared paths. The run directory is written once, here, and the data tokenised once, here, into
the cache (`data.cache_dir`, default `<train.output_dir>/data_cache`); every node reads plan.json,
the rendered configs and the cache at the same absolute paths and writes its logs, checkpoints and
the trained model into the run directory. So both must be on a filesystem every node mounts at the
same path (NFS, Lustre, a cluster home), and orchestrate must be installed at the same interpreter
path on every node (`python`, default this process's own). Nothing checks this up front: a node that
lacks a path fails at start with "plan file ... not found" or "No such file" in its output.

Stopping and resuming as on one node: torchrun on every node forwards SIGTERM/SIGUSR1 to its
workers and waits `train.preemption_grace_s` for their checkpoint; workers that stopped early leave
RUN_DIR/REQUEUE, and the launch then returns EX_TEMPFAIL (75). `resume=True` continues the newest
run (or `run_dir`) from its latest checkpoint (`orchestrate.launch.resume`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.errors import Problem, UserError
from orchestrate.launch import slurm, slurm_cluster, ssh, ssh_commands
from orchestrate.launch.hostfile import Host
from orchestrate.launch.launcher import (
    LAUNCH_SCRIPT,
    LaunchResult,
    launch_env,
    prepare_run_dir,
    say,
    write_launch_script,
)
from orchestrate.launch.rundir import LOG_DIR, PLAN_FILE
from orchestrate.launch.slurm import SlurmJob
from orchestrate.launch.slurm_cluster import SlurmAllocation
from orchestrate.planner.plan import Plan

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrate.api import HardwareFlags
    from orchestrate.config.schema import RunConfig

STOP_MARGIN_S = 15
"""After Ctrl-C or a failed host: how much longer than the workers' checkpoint grace
(`train.preemption_grace_s`) srun or a host may take to stop before it is killed."""


def worker_torchrun_args(run_dir: Path, max_restarts: int = 0) -> tuple[str, ...]:
    """torchrun options every node gets: per-rank logs under RUN_DIR/logs (each node's torchrun
    makes its own subdirectory), local rank 0's output echoed (the `--tee` of a local launch)."""
    return ("--max-restarts", str(max_restarts), "--log-dir", str(run_dir / LOG_DIR),
            "--redirects", "3", "--tee", "0:3")


def _worker_program(plan_path: Path) -> tuple[str, ...]:
    return ("-m", "orchestrate.worker", str(plan_path))


# --- The hardware of a multi-node job -------------------------------------------------------------


def hardware_for_hosts(flags: HardwareFlags, hosts: Sequence[Host]) -> HardwareFlags:
    """The hardware flags with the hostfile's shape: one node per host, `slots` ranks on each."""
    problems = []
    slots = sorted({h.slots for h in hosts})
    if len(slots) > 1:
        listing = ", ".join(f"{h.name} slots={h.slots}" for h in hosts)
        problems.append(Problem("--hosts", f"the hosts have different slots ({listing})",
                                "give every host the same slots=: a plan runs the same ranks on every node"))
    if flags.nodes is not None and flags.nodes != len(hosts):
        problems.append(Problem("--nodes", f"{flags.nodes} contradicts the hostfile's {len(hosts)} host(s)",
                                "leave --nodes out: the hostfile decides"))
    per_node = flags.gpus_per_node if flags.gpus_per_node is not None else flags.gpus
    if per_node is not None and slots and per_node != slots[0]:
        flag = "--gpus-per-node" if flags.gpus_per_node is not None else "--gpus"
        problems.append(Problem(flag, f"{per_node} contradicts the hostfile's slots={slots[0]}",
                                "leave it out: the hostfile's slots= decide"))
    if problems:
        raise UserError("the hostfile and the hardware flags disagree", problems)
    if flags.gpus_per_node is not None:
        return dataclasses.replace(flags, nodes=len(hosts))
    return dataclasses.replace(flags, nodes=len(hosts), gpus=slots[0])


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


def _prepare_data(plan: Plan, run_dir: Path, console: Console | None, messages: list[str]) -> None:
    """Tokenise once, here, into the shared cache, so the nodes' local rank 0s do not race to build it."""
    from orchestrate.data.pipeline import prepare_for_plan

    _say(console, messages, prepare_for_plan(plan, run_dir, progress=console is not None))


def _requeue_code(run_dir: Path, code: int, console: Console | None, messages: list[str]) -> int:
    """EX_TEMPFAIL when the workers checkpointed on a stop signal (RUN_DIR/REQUEUE), else `code`."""
    from orchestrate.worker.signals import EX_TEMPFAIL, read_requeue

    requeue = read_requeue(run_dir)
    if requeue is None:
        return code
    _say(console, messages, f"checkpointed at step {requeue.get('step', '?')} after {requeue.get('signal')} "
                            f"(exit {EX_TEMPFAIL}: requeue)")
    return EX_TEMPFAIL


def _say(console: Console | None, messages: list[str], text: str) -> None:
    say(console, messages, text, soft_wrap=True)  # commands and host lines stay copyable


def _describe(plan: Plan) -> str:
    hw = plan.hardware
    what = f"{hw.gpus_per_node} GPU(s)" if hw.has_gpu else f"{hw.cpu_processes} CPU process(es) (gloo)"
    return f"{hw.nodes} node(s) x {what}: {plan.world_size} ranks; strategy {plan.chosen.name}"


# --- SLURM batch job ------------------------------------------------------------------------------


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
    plan: Plan
    run_dir: Path
    script: Path
    job: SlurmJob
    messages: list[str]


def slurm_job_for_plan(plan: Plan, run_dir: Path, options: SlurmOptions = SlurmOptions(),
                       max_restarts: int = 0, name: str = "orchestrate") -> SlurmJob:
    """The batch job that runs RUN_DIR/plan.json: a node per plan node, a torchrun on each."""
    hw = plan.hardware
    grace = plan.config.train.preemption_grace_s
    # The script sets torchrun's shutdown timeout itself (from shutdown_grace_s).
    env = {k: v for k, v in launch_env(plan, run_dir / PLAN_FILE).items() if k != "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
    return SlurmJob(
        run_dir=run_dir, nodes=hw.nodes, procs_per_node=hw.ranks_per_node,
        gpus_per_node=hw.gpus_per_node if hw.has_gpu else 0, cpus_per_task=options.cpus_per_task,
        mem=options.mem, time=options.time, partition=options.partition, account=options.account,
        job_name=options.job_name or re.sub(r"[^\w.+-]", "-", name) or "orchestrate", python=options.python,
        program=_worker_program(run_dir / PLAN_FILE), torchrun_args=worker_torchrun_args(run_dir, max_restarts),
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
    # Check the job request before writing anything: a bad --time should not leave a run directory.
    grace = config.train.preemption_grace_s
    slurm.validate_job(SlurmJob(
        run_dir=Path("/"), nodes=hardware.nodes, procs_per_node=hardware.ranks_per_node,
        cpus_per_task=options.cpus_per_task, mem=options.mem, time=options.time,
        job_name=options.job_name or "orchestrate", python=options.python, shutdown_grace_s=grace,
        signal_lead_s=grace if options.signal_lead_s is None else options.signal_lead_s))
    messages: list[str] = []
    plan, run_dir = prepare_run_dir(config, hardware, name, run_dir, resume,
                                    lambda text: _say(console, messages, text))
    _prepare_data(plan, run_dir, console, messages)
    job = slurm_job_for_plan(plan, run_dir, options, max_restarts, name)
    script = slurm_cluster.write_sbatch(job)
    _say(console, messages, f"{_describe(plan)}; run directory {run_dir}")
    if hardware.has_gpu and not flags.profile and hardware.name.startswith("detected:cpu"):
        _say(console, messages, f"planned for {hardware.gpu.name} GPUs (no GPU here to measure): "
                                "pass --profile with your cluster's GPU for an accurate plan")
    _say(console, messages, f"job script: {script}")
    return PreparedJob(plan, run_dir, script, job, messages)


# --- Inside a SLURM allocation --------------------------------------------------------------------


def launch_in_allocation(config: RunConfig, flags: HardwareFlags, alloc: SlurmAllocation, *, name: str = "run",
                         run_dir: Path | None = None, dry_run: bool = False, max_restarts: int = 0,
                         python: str = sys.executable, resume: bool = False,
                         console: Console | None = None) -> LaunchResult:
    """Plan for the allocation's nodes, write the run directory and run `srun` (one torchrun per
    node, rendezvous on the first node); returns when every node has finished."""
    from orchestrate.worker.signals import clear_requeue

    messages: list[str] = []
    _say(console, messages, f"SLURM job {alloc.job_id}: launching on its {alloc.nnodes} node(s) with srun")
    plan, run_dir = prepare_run_dir(config, hardware_for_allocation(flags, alloc).resolve(), name, run_dir, resume,
                                    lambda text: _say(console, messages, text))
    plan_path = run_dir / PLAN_FILE
    # All of each node's allocated CPUs go to its one task (torchrun and its workers).
    job = slurm_job_for_plan(plan, run_dir, SlurmOptions(python=python, cpus_per_task=alloc.cpus_on_node),
                             max_restarts, name)
    argv = slurm_cluster.srun_argv_in_allocation(job, alloc)
    env = launch_env(plan, plan_path)
    command = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())), shlex.join(argv)])
    write_launch_script(run_dir, f"The exact command `orchestrate launch` ran inside SLURM job {alloc.job_id}.",
                         f"cd {shlex.quote(os.getcwd())}\n{command}")
    _say(console, messages, f"{_describe(plan)}; run directory {run_dir}")
    _say(console, messages, f"command: {command}")
    result = LaunchResult(plan, run_dir, plan_path, command, messages)
    if not dry_run:
        _prepare_data(plan, run_dir, console, messages)
        clear_requeue(run_dir)
        code = _run_srun(argv, env, plan.config.train.preemption_grace_s + STOP_MARGIN_S, console, messages)
        result.exit_code = _requeue_code(run_dir, code, console, messages)
    return result


def _run_srun(argv: list[str], env: dict[str, str], stop_grace_s: float, console: Console | None,
              messages: list[str]) -> int:
    """Run srun (the user's own environment wins over `env`). Ctrl-C sends it SIGTERM, which it
    forwards to every node's torchrun (a single SIGINT only makes srun print the tasks' states)."""
    proc = subprocess.Popen(argv, env={**env, **os.environ})
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        _say(console, messages, "interrupted: stopping the workers on every node")
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=stop_grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 130
    if code:
        _say(console, messages, f"srun exited with code {code} (a node's torchrun failed or stopped; "
                                "srun stops the others)")
    return code


# --- Over SSH -------------------------------------------------------------------------------------


def reject_with_hosts(**given: object) -> None:
    """UserError for rendezvous flags that make no sense with --hosts (it chooses the rendezvous)."""
    clash = [flag for flag, value in given.items() if value is not None]
    if clash:
        raise UserError("--hosts chooses the rendezvous itself", [Problem(
            f"--{flag.replace('_', '-')}", "cannot be combined with --hosts",
            "leave it out (--master-port sets the rendezvous port on the first host)") for flag in clash])


def launch_over_ssh(config: RunConfig, flags: HardwareFlags, hosts: Sequence[Host], *,
                    options: ssh.SshOptions | None = None, name: str = "run", run_dir: Path | None = None,
                    dry_run: bool = False, max_restarts: int = 0, python: str = sys.executable,
                    rdzv_port: int | None = None, resume: bool = False, console: Console | None = None,
                    out=None) -> LaunchResult:
    """Plan for len(hosts) nodes x slots, write the run directory, start torchrun on every host over
    SSH (rendezvous on the first) and wait. Output streams to `out` (default stdout) as
    `[host:position] line`. A failing host (or Ctrl-C) stops the others: `exit_code` is then the
    failure's (130 for Ctrl-C, 75 when the workers checkpointed) and `messages` says which host
    failed. `options.stop_grace_s` None: the workers' checkpoint grace plus a margin."""
    from orchestrate.worker.signals import clear_requeue

    messages: list[str] = []
    plan, run_dir = prepare_run_dir(config, hardware_for_hosts(flags, hosts).resolve(), name, run_dir, resume,
                                    lambda text: _say(console, messages, text))
    options = options or ssh.SshOptions()
    if options.stop_grace_s is None:
        options = dataclasses.replace(options, stop_grace_s=plan.config.train.preemption_grace_s + STOP_MARGIN_S)
    plan_path = run_dir / PLAN_FILE
    env = launch_env(plan, plan_path)
    commands = ssh.plan_commands(hosts, _worker_program(plan_path), python=python, options=options,
                                 torchrun_args=worker_torchrun_args(run_dir, max_restarts), rdzv_port=rdzv_port,
                                 rdzv_id=run_dir.name, env=env, probe_port=not dry_run)
    lines = [ssh_commands.ssh_command_line(c, options) + " &" for c in commands]
    command = "\n".join([*lines, "wait"])
    write_launch_script(run_dir, "What `orchestrate launch --hosts` ran: one torchrun per host over SSH "
                                  "(by hand, nothing stops the others when one fails).", command)
    endpoint = next(a.split("=", 1)[1] for a in commands[0].argv if a.startswith("--rdzv-endpoint="))
    _say(console, messages, f"{_describe(plan)}; run directory {run_dir} (every host must see it at this path)")
    _say(console, messages, f"hosts: {', '.join(h.name for h in hosts)}; rendezvous {endpoint}")
    _say(console, messages, f"commands: {run_dir / LAUNCH_SCRIPT}")
    result = LaunchResult(plan, run_dir, plan_path, command, messages)
    if dry_run:
        return result
    _prepare_data(plan, run_dir, console, messages)
    clear_requeue(run_dir)
    try:
        ssh.run_commands(commands, options, out)
        code = 0
    except ssh.HostFailure as failure:
        _say(console, messages, f"error: {failure}")
        code = failure.failed.exit_code if failure.failed.exit_code and failure.failed.exit_code > 0 else 1
    except KeyboardInterrupt:
        _say(console, messages, "interrupted: stopped the workers on every host")
        code = 130
    result.exit_code = _requeue_code(run_dir, code, console, messages)
    return result
