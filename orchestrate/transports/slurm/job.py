"""SLURM batch jobs: render the sbatch script, submit it, wait for it, and read an allocation.

One `srun` task per node runs torchrun; the nodes meet in a c10d rendezvous hosted by the first
node of the allocation, at the address slurmctld itself uses to reach that node (`NodeAddr`; a
node's name is not always resolvable from the others).

Checkpoint and requeue. The script asks Slurm for `--signal=B:USR1@<lead>`: USR1 goes to the batch
shell only, `lead` seconds before the time limit (`scancel -s USR1 -b JOB` sends the same by hand).
Sending USR1 to the job steps instead would kill torchrun, which dies of an unhandled USR1 (before
torch 2.8 it cannot be told to handle it) while its workers are still writing the checkpoint. So
the batch shell traps USR1 and sends SIGTERM to the steps (`scancel --signal=TERM JOB`, which never
reaches the batch shell): torchrun handles SIGTERM by forwarding it to its workers and waiting
TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds before SIGKILL; the workers checkpoint and exit. Once the
step has ended, the script requeues the job (`scontrol requeue`) when the step did not finish cleanly
and either the batch shell was signalled, or the workers left RUN_DIR/REQUEUE (they checkpointed on a
stop signal that came another way, e.g. `scancel -s USR1 JOB` to the steps, which torchrun forwards
when PET_SIGNALS_TO_HANDLE lists USR1), or the step exited EX_TEMPFAIL (75, "checkpointed, please
requeue"; torchrun reports a failed worker as exit 1 whatever its own code, so 75 only shows through
for payloads that pass it on). A plain `scancel` (SIGTERM to everything) still cancels: the batch
shell dies with it, and only it requeues. Preemption with PreemptMode=REQUEUE needs
nothing from the script: Slurm sends SIGTERM to every process and requeues by itself.

This module is pure: the job (`SlurmJob`), its checks and the rendered script and srun command.
Reading an allocation and running Slurm's commands (sbatch, scontrol) is `slurm_cluster`'s job.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrate.errors import Problem, UserError
from orchestrate.launch.addresses import port_problem
from orchestrate.launch.torchrun_args import TEED_PREFIX
from orchestrate.run.exits import EX_TEMPFAIL
from orchestrate.run.layout import PLAN_FILE, REQUEUE_FILE, worker_program

DEFAULT_SIGNAL_LEAD_S = 120
_PORT_BASE, _PORT_SPAN = 20000, 20000
"""Default rendezvous port: 20000 + job id % 20000, the same on every node of a job and different
for jobs that share a head node (a port chosen on the submit host would mean nothing there)."""

_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_MEM = re.compile(r"^\d+[KMGT]?$")
NAME_CHARS = "A-Za-z0-9_.+,-"
"""What a Slurm name (job name, partition or partition list, account) may hold: nothing sbatch's
#SBATCH parser or a shell reads specially (no whitespace, quote, #, $ or backslash)."""
_NAME = re.compile(f"^[{NAME_CHARS}]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SBATCH_BARE = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")
_HETJOB = re.compile(r"hetjob|packjob", re.IGNORECASE)
# Each node's one task: host the rendezvous store on node 0 (explicitly: the hostname heuristic
# fails when NodeAddr is an address the node does not know as its own), give torchrun the node's
# NodeAddr as its address (the workers' store lives there when the node is the rendezvous' rank 0,
# launcher.launch_env; the FQDN guess can be unreachable), then exec torchrun.
_NODE_SHELL = ('a=$(scontrol show node -o "$SLURMD_NODENAME" 2>/dev/null); '
               'case $a in *NodeAddr=*) a=${a#*NodeAddr=}; a=${a%% *};; *) a=$SLURMD_NODENAME;; esac; '
               'exec "$0" -m torch.distributed.run --local-addr="$a" --rdzv-conf="is_host=$((SLURM_NODEID == 0))" "$@"')


class Sh(str):
    """Shell text emitted verbatim (it expands variables), unlike plain strings, which are quoted."""


def _sh_join(argv: Sequence[str]) -> str:
    return " ".join(a if isinstance(a, Sh) else shlex.quote(a) for a in argv)


@dataclass(frozen=True)
class SlurmJob:
    """Everything the batch script needs; see `validate_job` for the rules."""

    run_dir: Path
    """Absolute; holds plan.json, the script and the job's output (slurm-<job id>.out)."""
    nodes: int
    procs_per_node: int
    """torchrun --nproc-per-node: GPUs per node, or CPU processes when gpus_per_node is 0."""
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    """CPUs for each node's one task (torchrun and all its workers); default one per process."""
    mem: str | None = None
    """Memory per node as Slurm writes it ("64G"); None: the partition's default."""
    time: str | None = None
    """Time limit ("4:00:00", "1-00:00:00"); None: the partition's default."""
    partition: str | None = None
    account: str | None = None
    job_name: str = "orchestrate"
    python: str = sys.executable
    """Absolute interpreter path on the compute nodes (the same shared filesystem path as here)."""
    program: tuple[str, ...] = ()
    """What torchrun runs, after its options; default `-m orchestrate.worker RUN_DIR/plan.json`."""
    torchrun_args: tuple[str, ...] = ()
    """Extra torchrun options (e.g. --max-restarts, --log-dir), placed before the program. Not
    --rdzv-conf: it would replace the per-node `is_host` setting."""
    signal_lead_s: int = DEFAULT_SIGNAL_LEAD_S
    """Seconds before the time limit to ask for a checkpoint (USR1 to the batch shell); 0: never."""
    shutdown_grace_s: int | None = None
    """Seconds torchrun gives the workers to checkpoint after SIGTERM before it SIGKILLs them
    (TORCH_ELASTIC_SHUTDOWN_TIMEOUT); default: signal_lead_s, or 30 without a signal."""
    requeue: bool = True
    max_requeues: int = 20
    """Stop requeueing after this many restarts (a job that fails the same way forever)."""
    rdzv_port: int | None = None
    extra_sbatch: tuple[str, ...] = ()
    """Further sbatch options, one per `#SBATCH` line ("--exclusive", "--constraint=a100")."""
    env: tuple[tuple[str, str], ...] = ()
    """Library settings for the workers (plan.json's `run.env`), exported by the script unless the
    job's environment has them already; srun passes them on to every node."""

    @property
    def payload(self) -> tuple[str, ...]:
        return self.program or worker_program(self.run_dir / PLAN_FILE)


def parse_time_limit(text: str) -> int:
    """Seconds in a Slurm time limit: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    m = _TIME.match(text.strip())
    if not m:
        raise ValueError(text)
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


# --- One rule per kind of value the #SBATCH lines carry --------------------------------------------
#
# sbatch reads an #SBATCH line itself (src/sbatch/opt.c, `_get_argument`): words split at whitespace,
# '...' and "..." group, a backslash escapes the next character, an unquoted # ends the line; a line
# that mentions hetjob (packjob) anywhere starts another job component. `sbatch_word` writes any
# value that passes `_sbatch_text_problem` as exactly one such word.


def _sbatch_text_problem(text: str) -> str | None:
    """Why `text` cannot be written into an #SBATCH line as one word, or None."""
    if not text.isprintable():
        return f"{text!r} holds a line break or another control character"
    if _HETJOB.search(text):
        return f"{text!r} mentions hetjob/packjob, which makes sbatch start another job component"
    return None


def _name_problem(text: str) -> str | None:
    """A job name, partition (or comma-separated list) or account."""
    if not _NAME.match(text):
        return f"{text!r}: letters, digits and . _ + - , only"
    return _sbatch_text_problem(text)


def _time_problem(text: str) -> str | None:
    try:
        parse_time_limit(text)
    except ValueError:
        return f"{text!r} is not a Slurm time limit"
    return None


def _mem_problem(text: str) -> str | None:
    return None if _MEM.match(text) else f"{text!r} is not a Slurm memory size"


def _path_problem(path: Path) -> str | None:
    """A directory in --chdir and --output: absolute, and without the backslash that turns off
    --output's %j (a % is written as %%, see `_sbatch_header`)."""
    if not path.is_absolute():
        return f"{path} is relative"
    if "\\" in str(path):
        return f"{str(path)!r} holds a backslash, which stops sbatch from naming the output file per job"
    return _sbatch_text_problem(str(path))


def _option_problem(text: str) -> str | None:
    """One extra sbatch option (`--exclusive`, `--constraint=a100`), one per #SBATCH word."""
    if not text.startswith("-"):
        return f"{text!r} is not an option (they start with -)"
    return _sbatch_text_problem(text)


def sbatch_word(text: str) -> str:
    """`text` (already through `_sbatch_text_problem`) as one word of an #SBATCH line: bare when
    it is plain, else in double quotes with \\ and \" escaped."""
    if _SBATCH_BARE.match(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def validate_job(job: SlurmJob) -> None:
    """Raise one UserError listing every problem with the job request."""
    problems = []
    if job.nodes < 1:
        problems.append(Problem("--nodes", f"{job.nodes} given", "at least 1"))
    if job.procs_per_node < 1:
        problems.append(Problem("--gpus-per-node", f"{job.procs_per_node} processes per node",
                                "at least 1 process per node"))
    if job.gpus_per_node < 0:
        problems.append(Problem("--gpus-per-node", f"{job.gpus_per_node} given", "0 or more"))
    if job.gpus_per_node and job.procs_per_node > job.gpus_per_node:
        problems.append(Problem("--gpus-per-node", f"{job.procs_per_node} processes on {job.gpus_per_node} GPUs",
                                "one process per GPU"))
    if job.cpus_per_task is not None and job.cpus_per_task < 1:
        problems.append(Problem("--cpus-per-task", f"{job.cpus_per_task} given", "at least 1"))
    for flag, value in (("--job-name", job.job_name), ("--partition", job.partition), ("--account", job.account)):
        if value is not None and (bad := _name_problem(value)):
            problems.append(Problem(flag, bad, "the name as Slurm knows it (sinfo, sacctmgr show assoc)"))
    if job.mem is not None and (bad := _mem_problem(job.mem)):
        problems.append(Problem("--mem", bad, "e.g. 64G or 128000M"))
    limit = None
    if job.time is not None:
        if bad := _time_problem(job.time):
            problems.append(Problem("--time", bad, "e.g. 4:00:00 or 1-12:00:00"))
        else:
            limit = parse_time_limit(job.time)
    if job.signal_lead_s < 0:
        problems.append(Problem("--signal", f"{job.signal_lead_s} s before the limit", "0 (off) or more"))
    elif job.signal_lead_s and job.shutdown_grace_s and job.signal_lead_s < job.shutdown_grace_s:
        problems.append(Problem("--signal", f"the checkpoint signal comes {job.signal_lead_s} s before the time "
                                f"limit, but the workers get {job.shutdown_grace_s} s to checkpoint "
                                "(train.preemption_grace_s): the limit would kill them mid-checkpoint",
                                f"a lead of at least {job.shutdown_grace_s} s, or a shorter train.preemption_grace_s"))
    elif limit is not None and job.signal_lead_s and job.signal_lead_s >= limit:
        problems.append(Problem("--time", f"the checkpoint signal comes {job.signal_lead_s} s before a "
                                f"{limit} s limit, so at the start", "a longer --time or a shorter lead"))
    if not Path(job.python).is_absolute():
        problems.append(Problem("python", f"{job.python!r} is not an absolute path",
                                "compute nodes must run the same interpreter: give its full path"))
    if bad := _path_problem(job.run_dir):
        problems.append(Problem("run_dir", bad, "an absolute path without control characters or backslashes"))
    if job.rdzv_port is not None and (bad := port_problem(job.rdzv_port)):
        problems.append(Problem("rdzv_port", bad))
    for name, _ in job.env:
        if not _ENV_NAME.match(name):
            problems.append(Problem("env", f"{name!r} is not an environment variable name"))
    for option in job.extra_sbatch:
        if bad := _option_problem(option):
            problems.append(Problem("--sbatch-option", bad, "one sbatch option per --sbatch-option"))
    if problems:
        raise UserError("cannot write the SLURM job", problems)


def _cpus(job: SlurmJob) -> int:
    return job.cpus_per_task or job.procs_per_node


def _srun_groups(job: SlurmJob, nnodes: str, rdzv_endpoint: str, rdzv_id: str) -> list[list[str]]:
    """The srun command in display lines: srun options, the per-node shell, torchrun, payload."""
    srun = ["srun", _flag("--nodes", nnodes), "--ntasks-per-node=1", f"--cpus-per-task={_cpus(job)}"]
    if job.gpus_per_node:
        srun.append(f"--gpus-per-node={job.gpus_per_node}")
    # --kill-on-bad-exit: a node whose torchrun fails takes the others down instead of leaving
    # them waiting in a collective; --label prefixes each output line with the node's task number.
    srun += ["--kill-on-bad-exit=1", "--label"]
    torchrun = [job.python, _flag("--nnodes", nnodes), f"--nproc-per-node={job.procs_per_node}",
                "--rdzv-backend=c10d", _flag("--rdzv-endpoint", rdzv_endpoint), _flag("--rdzv-id", rdzv_id)]
    return [srun, ["bash", "-c", _NODE_SHELL], torchrun, [*job.torchrun_args, *job.payload]]


_LABELLED_TEED = re.compile(r"^(\s*\d+: )" + re.escape(TEED_PREFIX))
"""srun --label's "<task>: " (padded to the widest task number), then torchrun's teed prefix."""


def without_teed_prefix_after_label(line: str) -> str:
    """A line of the srun step's output as orchestrate shows it: srun's label (the node's task
    number) kept, torchrun's prefix on local rank 0's teed lines dropped, as local and SSH launches
    drop it: `0: [default0]:step 1/4` -> `0: step 1/4`."""
    return _LABELLED_TEED.sub(r"\1", line, count=1)


def srun_argv(job: SlurmJob, *, nnodes: str, rdzv_endpoint: str, rdzv_id: str) -> list[str]:
    """`srun ...` running one torchrun per node. Values may be `Sh` text when rendered into a script
    (`$SLURM_NNODES`) or plain strings when run directly inside an allocation."""
    return [a for group in _srun_groups(job, nnodes, rdzv_endpoint, rdzv_id) for a in group]


def default_rdzv_port(job_id: str) -> int:
    return _PORT_BASE + int(job_id) % _PORT_SPAN


def _flag(name: str, value: str) -> str:
    return Sh(f'{name}="{value}"') if isinstance(value, Sh) else f"{name}={value}"


def _sbatch_header(job: SlurmJob) -> str:
    opts = [f"--job-name={job.job_name}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
            f"--cpus-per-task={_cpus(job)}"]
    if job.gpus_per_node:
        opts.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.mem:
        opts.append(f"--mem={job.mem}")
    if job.time:
        opts.append(f"--time={job.time}")
    if job.partition:
        opts.append(f"--partition={job.partition}")
    if job.account:
        opts.append(f"--account={job.account}")
    # Append: a requeued run must not truncate the first run's output. --output is a file name
    # pattern (%j: the job id), so the run directory's own % are doubled.
    output = str(job.run_dir).replace("%", "%%") + "/slurm-%j.out"
    opts += [f"--output={output}", "--open-mode=append", f"--chdir={job.run_dir}"]
    if job.signal_lead_s:
        opts.append(f"--signal=B:USR1@{job.signal_lead_s}")
    opts.append("--requeue" if job.requeue else "--no-requeue")
    opts += list(job.extra_sbatch)
    return "\n".join(f"#SBATCH {sbatch_word(o)}" for o in opts)


def _requeue_block(job: SlurmJob) -> str:
    if not job.requeue:
        return ""
    marker = shlex.quote(str(job.run_dir / REQUEUE_FILE))
    return f"""\
# Requeue when the step did not finish and was asked to stop (USR1 here), or the workers checkpointed
# on a stop signal (they leave REQUEUE), or it exited {EX_TEMPFAIL} (EX_TEMPFAIL).
if [ "$rc" -ne 0 ] && {{ [ "$signalled" = 1 ] || [ -f {marker} ] || [ "$rc" -eq {EX_TEMPFAIL} ]; }}; then
    if [ "${{SLURM_RESTART_COUNT:-0}}" -ge {job.max_requeues} ]; then
        echo "orchestrate: not requeueing: already restarted {job.max_requeues} times"
    else
        echo "orchestrate: step exited $rc; requeueing job $SLURM_JOB_ID to resume from the checkpoint"
        scontrol requeue "$SLURM_JOB_ID"
    fi
fi
"""


def render_sbatch(job: SlurmJob) -> str:
    """The batch script for `job` (validated first). Deterministic: golden-tested."""
    validate_job(job)
    header, requeue = _sbatch_header(job), _requeue_block(job)
    port = str(job.rdzv_port) if job.rdzv_port else f"$(({_PORT_BASE} + SLURM_JOB_ID % {_PORT_SPAN}))"
    srun = " \\\n    ".join(_sh_join(group) for group in _srun_groups(
        job, nnodes=Sh("$SLURM_NNODES"), rdzv_endpoint=Sh("$head_addr:$rdzv_port"), rdzv_id=Sh("$SLURM_JOB_ID")))
    grace = job.shutdown_grace_s or job.signal_lead_s or 30
    env = "".join(f'[ -n "${{{name}+set}}" ] || export {name}={shlex.quote(value)}\n' for name, value in job.env)
    if env:
        env = "\n# Library settings from plan.json (run.env) for the workers; values set already win.\n" + env
    return f"""\
#!/bin/bash
# Written by orchestrate: {job.nodes} node(s) x {job.procs_per_node} process(es), one torchrun per node.
{header}
set -uo pipefail
{env}
# The c10d rendezvous store lives on the first node, at the address slurmctld uses for it.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
head_addr=$(scontrol show node "$head_node" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p' | head -n 1)
head_addr=${{head_addr:-$head_node}}
rdzv_port={port}
echo "orchestrate: job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}) on $SLURM_JOB_NODELIST," \\
     "rendezvous $head_addr:$rdzv_port"

# USR1 (from Slurm before the time limit, or `scancel -s USR1 -b JOB`) means checkpoint and requeue:
# SIGTERM the job steps; torchrun forwards it to the workers and gives them this long to save.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={grace}
signalled=0
on_usr1() {{
    signalled=1
    echo "orchestrate: USR1: asking the workers to checkpoint and stop"
    scancel --signal=TERM "$SLURM_JOB_ID"
}}
trap on_usr1 USR1

{srun} &
step=$!
# `wait` returns early when the trap runs; wait again until the step has really ended.
while :; do
    wait "$step"
    rc=$?
    kill -0 "$step" 2>/dev/null || break
done
echo "orchestrate: step exited $rc"
{requeue}exit "$rc"
"""
