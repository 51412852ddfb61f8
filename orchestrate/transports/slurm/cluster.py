"""Talking to a live Slurm: the allocation a process runs in (Slurm's environment variables),
Slurm's answers (pure parsers), and the few functions that run Slurm commands (sbatch, scontrol).

The job and its batch script are `orchestrate.transports.slurm.job`'s (pure rendering).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from orchestrate.errors import Problem, UserError
from orchestrate.run.layout import SBATCH_SCRIPT
from orchestrate.transports.slurm.job import SlurmJob, default_rdzv_port, render_sbatch, srun_argv

TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE",
})


# --- Reading Slurm's answers (pure) ---------------------------------------------------------------

_FIELD = re.compile(r"(?:^|\s)([A-Za-z:/]+)=(\S*)")


def parse_scontrol_record(text: str) -> dict[str, str]:
    """Key=value pairs of one `scontrol show job -o` / `show node -o` record (values without spaces)."""
    return {k: v for k, v in _FIELD.findall(text)}


def parse_job_id(sbatch_parsable: str) -> str:
    """`sbatch --parsable` prints `ID` or `ID;CLUSTER`."""
    first = sbatch_parsable.strip().splitlines()[-1] if sbatch_parsable.strip() else ""
    job_id = first.split(";")[0]
    if not job_id.isdigit():
        raise ValueError(f"unexpected sbatch output: {sbatch_parsable!r}")
    return job_id


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list ("n[1-3,7],gpu[01-02]-ib") as names, in order, like
    `scontrol show hostnames`; ranges keep their zero padding."""
    hosts: list[str] = []
    for item in _split_top(hostlist):
        hosts += _expand_one(item)
    return hosts


def _split_top(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if not m:
        return [item]
    prefix, suffix = item[: m.start()], item[m.end():]
    names = []
    for rng in m.group(1).split(","):
        lo, _, hi = rng.partition("-")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            names.append(f"{prefix}{n:0{width}d}")
    return [head + tail for head in names for tail in _expand_one(suffix)] if "[" in suffix else \
        [head + suffix for head in names]


@dataclass(frozen=True)
class SlurmAllocation:
    """What a process inside a Slurm job knows about it (from Slurm's environment variables)."""

    job_id: str
    nnodes: int
    nodes: tuple[str, ...]
    node_id: int | None
    """This node's index in `nodes`; None outside a job step or batch script (e.g. an salloc shell)."""
    gpus_on_node: int | None
    """SLURM_GPUS_ON_NODE (job steps, batch scripts), else SLURM_GPUS_PER_NODE (an salloc shell)."""
    cpus_on_node: int | None
    """SLURM_CPUS_ON_NODE, else the first node's count in SLURM_JOB_CPUS_PER_NODE ("4(x2),2")."""
    in_step: bool
    """True inside an srun step (SLURM_STEP_ID set): launching another srun here would nest steps."""

    @property
    def head_node(self) -> str:
        return self.nodes[0]


def detect_slurm_allocation(env: Mapping[str, str] | None = None) -> SlurmAllocation | None:
    """The allocation this process runs in, or None outside Slurm."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    nodes = tuple(expand_hostlist(nodelist))
    nnodes = _int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")) or len(nodes) or 1
    return SlurmAllocation(
        job_id=job_id, nnodes=nnodes, nodes=nodes, node_id=_int(env.get("SLURM_NODEID")),
        gpus_on_node=_int(env.get("SLURM_GPUS_ON_NODE")) or _int(env.get("SLURM_GPUS_PER_NODE", "").rsplit(":", 1)[-1]),
        cpus_on_node=_int(env.get("SLURM_CPUS_ON_NODE"))
        or _int(re.split(r"[(,]", env.get("SLURM_JOB_CPUS_PER_NODE", ""))[0]),
        in_step="SLURM_STEP_ID" in env and env.get("SLURM_STEP_ID") not in ("batch", "extern"))


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None


# --- Running Slurm commands -----------------------------------------------------------------------


def _run(argv: list[str], what: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise UserError(f"cannot {what}: `{argv[0]}` is not installed here", [Problem(
            argv[0], "command not found", "run this on a SLURM login node (or install slurm-client)")]) from None


def write_sbatch(job: SlurmJob, path: Path | None = None) -> Path:
    """Render the script into RUN_DIR/job.sbatch (or `path`); returns the path."""
    path = path or job.run_dir / SBATCH_SCRIPT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_sbatch(job))
    path.chmod(0o755)
    return path


def test_only(script: Path) -> str:
    """`sbatch --test-only`: Slurm checks the script against the real cluster without queueing it.
    Returns Slurm's estimate ("Job N to start at ... on nodes ..."); UserError when rejected."""
    proc = _run(["sbatch", "--test-only", str(script)], "check the job")
    message = (proc.stderr + proc.stdout).strip()
    if proc.returncode != 0:
        raise UserError("SLURM rejected the job script", [Problem(str(script), message or f"exit {proc.returncode}")])
    return message


test_only.__test__ = False  # type: ignore[attr-defined]  # not a pytest test despite the name


def submit(script: Path) -> str:
    """`sbatch --parsable SCRIPT`; returns the job id."""
    proc = _run(["sbatch", "--parsable", str(script)], "submit the job")
    if proc.returncode != 0:
        raise UserError("SLURM rejected the job script", [Problem(
            str(script), (proc.stderr or proc.stdout).strip() or f"sbatch exit {proc.returncode}")])
    return parse_job_id(proc.stdout)


def job_info(job_id: str) -> dict[str, str]:
    """`scontrol show job -o JOB` as a dict (JobState, ExitCode, Restarts, NodeList, ...)."""
    proc = _run(["scontrol", "show", "job", "-o", job_id], "query the job", timeout=30)
    if proc.returncode != 0:
        raise UserError(f"SLURM does not know job {job_id}", [Problem(
            job_id, (proc.stderr or proc.stdout).strip(), "finished jobs are forgotten after MinJobAge")])
    return parse_scontrol_record(proc.stdout)


def head_address(node: str) -> str:
    """The address slurmctld uses for `node` (NodeAddr), which the other nodes can reach too."""
    proc = _run(["scontrol", "show", "node", "-o", node], "query the node", timeout=30)
    return parse_scontrol_record(proc.stdout).get("NodeAddr") or node


def srun_argv_in_allocation(job: SlurmJob, alloc: SlurmAllocation) -> list[str]:
    """The srun command that starts the job's torchruns from inside an existing allocation (an
    salloc shell or a batch script the user wrote); `job.nodes` is ignored: the allocation decides."""
    port = job.rdzv_port or default_rdzv_port(alloc.job_id)
    return srun_argv(job, nnodes=str(alloc.nnodes), rdzv_endpoint=f"{head_address(alloc.head_node)}:{port}",
                     rdzv_id=alloc.job_id)
