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

Shared paths. The run directory is written once, here; every node reads plan.json and the rendered
configs at the same absolute path and writes its logs, checkpoints and the trained model there. So
the run directory must be on a filesystem every node mounts at the same path (NFS, Lustre, a
cluster home), and orchestrate must be installed at the same interpreter path on every node
(`python`, default this process's own). Nothing checks this up front: a node that lacks the path
fails at start with "plan file ... not found" or "No such file" in its output.
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
from orchestrate.launch import slurm, ssh
from orchestrate.launch.hostfile import Host
from orchestrate.launch.launcher import LAUNCH_SCRIPT, LaunchResult, build_plan
from orchestrate.launch.rundir import LOG_DIR, PLAN_FILE, default_run_dir, prepare_run, read_run_info
from orchestrate.launch.slurm import SlurmAllocation, SlurmJob
from orchestrate.planner.plan import Plan

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrate.api import HardwareFlags
    from orchestrate.config.schema import RunConfig
    from orchestrate.hardware.profile import HardwareProfile

SRUN_STOP_GRACE_S = 60
"""After Ctrl-C: how long srun (which forwards SIGTERM to every node's torchrun) may take to stop."""


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
    do not say (SLURM_GPUS_ON_NODE; an salloc shell on a login node may not know them)."""
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
    alloc = slurm.detect_slurm_allocation(env)
    if alloc is None or explicit_rendezvous or alloc.in_step:
        return None
    return alloc


def _prepare(config: RunConfig, hardware: HardwareProfile, name: str, run_dir: Path | None) -> tuple[Plan, Path]:
    """Plan (UserError when nothing fits), check the data, write the run directory."""
    from orchestrate.data.pipeline import check_data_config

    plan = build_plan(config, hardware)
    check_data_config(config, plan.shape.max_position_embeddings, plan.shape.vocab_size)
    run_dir = (run_dir or default_run_dir(config, name)).resolve()
    return prepare_run(plan, run_dir), run_dir


def _say(console: Console | None, messages: list[str], text: str) -> None:
    messages.append(text)
    if console is not None:
        console.print(text, markup=False, highlight=False, soft_wrap=True)


def _describe(plan: Plan) -> str:
    hw = plan.hardware
    what = f"{hw.gpus_per_node} GPU(s)" if hw.has_gpu else f"{hw.cpu_processes} CPU process(es) (gloo)"
    return f"{hw.nodes} node(s) x {what}: {plan.world_size} ranks; strategy {plan.chosen.name}"


def _write_launch_script(run_dir: Path, comment: str, body: str) -> None:
    path = run_dir / LAUNCH_SCRIPT
    path.write_text(f"#!/bin/sh\n# {comment}\n{body}\n")
    path.chmod(0o755)


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
    signal_lead_s: int = slurm.DEFAULT_SIGNAL_LEAD_S
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
    env = read_run_info(run_dir / PLAN_FILE).get("env", {})
    return SlurmJob(
        run_dir=run_dir, nodes=hw.nodes, procs_per_node=hw.ranks_per_node,
        gpus_per_node=hw.gpus_per_node if hw.has_gpu else 0, cpus_per_task=options.cpus_per_task,
        mem=options.mem, time=options.time, partition=options.partition, account=options.account,
        job_name=options.job_name or re.sub(r"[^\w.+-]", "-", name) or "orchestrate", python=options.python,
        program=_worker_program(run_dir / PLAN_FILE), torchrun_args=worker_torchrun_args(run_dir, max_restarts),
        signal_lead_s=options.signal_lead_s, requeue=options.requeue, extra_sbatch=options.extra_sbatch,
        env=tuple(sorted(env.items())))


def prepare_slurm_job(config: RunConfig, flags: HardwareFlags, *, name: str = "run", run_dir: Path | None = None,
                      options: SlurmOptions = SlurmOptions(), max_restarts: int = 0,
                      console: Console | None = None) -> PreparedJob:
    """Plan for `flags` (nodes x GPUs or CPU processes per node), write the run directory and
    RUN_DIR/job.sbatch. Nothing is submitted (`slurm.submit(prepared.script)` does that)."""
    hardware = flags.resolve()
    # Validate the job request before writing anything: a bad --time should not leave a run directory.
    probe = SlurmJob(run_dir=Path("/"), nodes=hardware.nodes, procs_per_node=hardware.ranks_per_node,
                     cpus_per_task=options.cpus_per_task, mem=options.mem, time=options.time,
                     job_name=options.job_name or "orchestrate", python=options.python,
                     signal_lead_s=options.signal_lead_s)
    slurm.validate_job(probe)
    plan, run_dir = _prepare(config, hardware, name, run_dir)
    job = slurm_job_for_plan(plan, run_dir, options, max_restarts, name)
    script = slurm.write_sbatch(job)
    messages: list[str] = []
    _say(console, messages, f"{_describe(plan)}; run directory {run_dir}")
    if hardware.has_gpu and not flags.profile and hardware.name.startswith("detected:cpu"):
        _say(console, messages, f"planned for {hardware.gpu.name} GPUs (no GPU here to measure): "
                                "pass --profile with your cluster's GPU for an accurate plan")
    _say(console, messages, f"job script: {script}")
    return PreparedJob(plan, run_dir, script, job, messages)


# --- Inside a SLURM allocation --------------------------------------------------------------------


def launch_in_allocation(config: RunConfig, flags: HardwareFlags, alloc: SlurmAllocation, *, name: str = "run",
                         run_dir: Path | None = None, dry_run: bool = False, max_restarts: int = 0,
                         python: str = sys.executable, console: Console | None = None) -> LaunchResult:
    """Plan for the allocation's nodes, write the run directory and run `srun` (one torchrun per
    node, rendezvous on the first node); returns when every node has finished."""
    plan, run_dir = _prepare(config, hardware_for_allocation(flags, alloc).resolve(), name, run_dir)
    plan_path = run_dir / PLAN_FILE
    # All of each node's allocated CPUs go to its one task (torchrun and its workers).
    job = slurm_job_for_plan(plan, run_dir, SlurmOptions(python=python, cpus_per_task=alloc.cpus_on_node),
                             max_restarts, name)
    argv = slurm.srun_argv_in_allocation(job, alloc)
    env = dict(job.env)
    command = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in job.env), shlex.join(argv)])
    _write_launch_script(run_dir, f"The exact command `orchestrate launch` ran inside SLURM job {alloc.job_id}.",
                         f"cd {shlex.quote(os.getcwd())}\n{command}")
    messages: list[str] = []
    _say(console, messages, f"SLURM job {alloc.job_id}: launching on its {alloc.nnodes} node(s) with srun")
    _say(console, messages, f"{_describe(plan)}; run directory {run_dir}")
    _say(console, messages, f"command: {command}")
    result = LaunchResult(plan, run_dir, plan_path, command, messages)
    if not dry_run:
        result.exit_code = _run_srun(argv, env, console, messages)
    return result


def _run_srun(argv: list[str], env: dict[str, str], console: Console | None, messages: list[str]) -> int:
    """Run srun; Ctrl-C sends it SIGTERM, which it forwards to every node's torchrun (a bare SIGINT
    only makes srun print the tasks' states)."""
    proc = subprocess.Popen(argv, env={**env, **os.environ})
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        _say(console, messages, "interrupted: stopping the workers on every node")
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=SRUN_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 130
    if code:
        _say(console, messages, f"srun exited with code {code} (a node's torchrun failed; srun stopped the others)")
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
                    rdzv_port: int | None = None, console: Console | None = None, out=None) -> LaunchResult:
    """Plan for len(hosts) nodes x slots, write the run directory, start torchrun on every host over
    SSH (rendezvous on the first) and wait. Output streams to `out` (default stdout) as
    `[host:position] line`. A failing host (or Ctrl-C) stops the others: `exit_code` is then the
    failure's (130 for Ctrl-C) and `messages` says which host failed."""
    options = options or ssh.SshOptions()
    plan, run_dir = _prepare(config, hardware_for_hosts(flags, hosts).resolve(), name, run_dir)
    plan_path = run_dir / PLAN_FILE
    env = read_run_info(plan_path).get("env", {})
    commands = ssh.plan_commands(hosts, _worker_program(plan_path), python=python, options=options,
                                 torchrun_args=worker_torchrun_args(run_dir, max_restarts), rdzv_port=rdzv_port,
                                 rdzv_id=run_dir.name, env=env, probe_port=not dry_run)
    lines = [ssh.ssh_command_line(c, options) + " &" for c in commands]
    command = "\n".join([*lines, "wait"])
    _write_launch_script(run_dir, "What `orchestrate launch --hosts` ran: one torchrun per host over SSH "
                                  "(by hand, nothing stops the others when one fails).", command)
    messages: list[str] = []
    endpoint = next(a.split("=", 1)[1] for a in commands[0].argv if a.startswith("--rdzv-endpoint="))
    _say(console, messages, f"{_describe(plan)}; run directory {run_dir} (every host must see it at this path)")
    _say(console, messages, f"hosts: {', '.join(h.name for h in hosts)}; rendezvous {endpoint}")
    _say(console, messages, f"commands: {run_dir / LAUNCH_SCRIPT}")
    result = LaunchResult(plan, run_dir, plan_path, command, messages)
    if dry_run:
        return result
    try:
        ssh.run_commands(commands, options, out)
        result.exit_code = 0
    except ssh.HostFailure as failure:
        _say(console, messages, f"error: {failure}")
        code = failure.failed.exit_code
        result.exit_code = code if code and code > 0 else 1
    except KeyboardInterrupt:
        _say(console, messages, "interrupted: stopped the workers on every host")
        result.exit_code = 130
    return result
