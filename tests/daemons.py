"""Find the real daemons that .ci/services/{slurm,sshd}.sh start, or skip with the reason.

The scripts record what tests need in $ORCH_CI_STATE/{slurm,ssh}/env.json (default state directory
/tmp/orchestrate-ci). A test that needs a daemon calls `require_slurm` / `require_sshd`; when the
daemon is not running it is skipped, or fails when ORCH_REQUIRE_DAEMONS=1 (set by
.ci/services/with-daemons.sh after it started them, so CI can never skip these tests silently).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrate.transports.slurm import cluster as slurm_cluster

START_HINT = ("start it with `bash .ci/services/{}.sh start` (root), or run the tests through "
              "`bash .ci/services/with-daemons.sh .venv/bin/python -m pytest ...`")


def state_dir() -> Path:
    return Path(os.environ.get("ORCH_CI_STATE", "/tmp/orchestrate-ci"))


def _unavailable(reason: str) -> None:
    if os.environ.get("ORCH_REQUIRE_DAEMONS") == "1":
        pytest.fail(f"{reason} (ORCH_REQUIRE_DAEMONS=1: the daemons should be running)")
    pytest.skip(reason)


def _read_env(service: str) -> dict[str, str]:
    path = state_dir() / service / "env.json"
    if not path.is_file():
        script = "slurm" if service == "slurm" else "sshd"
        _unavailable(f"{script} test daemon not started ({path} missing); " + START_HINT.format(script))
    return json.loads(path.read_text())


def _dead(pid_files: list[str]) -> list[str]:
    dead = []
    for name in pid_files:
        try:
            pid = int(Path(name).read_text().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            dead.append(name)
    return dead


@dataclass(frozen=True)
class SlurmCluster:
    conf: Path
    partition: str
    nodes: tuple[str, ...]
    gpus_per_node: int
    cpus_per_node: int


@dataclass(frozen=True)
class Sshd:
    host: str
    port: int
    user: str
    key: Path
    known_hosts: Path
    ssh_config: Path
    aliases: tuple[str, ...]
    """Two ssh config aliases of the same sshd: the tests' two "hosts"."""


def require_slurm(monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    env = _read_env("slurm")
    dead = _dead(env["ORCH_SLURM_PIDS"].split())
    if dead:
        _unavailable(f"SLURM test cluster not running (no process for {', '.join(dead)}); " + START_HINT.format("slurm"))
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    probe = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        _unavailable(f"SLURM test cluster does not answer: {probe.stderr.strip()}")
    return SlurmCluster(conf=Path(env["SLURM_CONF"]), partition=env["ORCH_SLURM_PARTITION"],
                        nodes=tuple(env["ORCH_SLURM_NODES"].split(",")),
                        gpus_per_node=int(env["ORCH_SLURM_GPUS_PER_NODE"]),
                        cpus_per_node=int(env["ORCH_SLURM_CPUS_PER_NODE"]))


def require_sshd() -> Sshd:
    env = _read_env("ssh")
    if _dead([env["ORCH_SSH_PID_FILE"]]):
        _unavailable("test sshd not running; " + START_HINT.format("sshd"))
    try:
        socket.create_connection((env["ORCH_SSH_HOST"], int(env["ORCH_SSH_PORT"])), timeout=5).close()
    except OSError as e:
        _unavailable(f"test sshd does not accept connections: {e}")
    return Sshd(host=env["ORCH_SSH_HOST"], port=int(env["ORCH_SSH_PORT"]), user=env["ORCH_SSH_USER"],
                key=Path(env["ORCH_SSH_KEY"]), known_hosts=Path(env["ORCH_SSH_KNOWN_HOSTS"]),
                ssh_config=Path(env["ORCH_SSH_CONFIG"]), aliases=tuple(env["ORCH_SSH_ALIASES"].split()))


def wait_job(job_id: str, timeout: float, poll_s: float = 0.1) -> dict[str, str]:
    """Poll `scontrol show job` until the job reaches a final state; returns its record.
    (`sbatch --wait` polls every 2 s, then 8 s: far too slow for tests and CLI feedback.)"""
    deadline = time.monotonic() + timeout
    while True:
        info = slurm_cluster.job_info(job_id)
        if info.get("JobState") in slurm_cluster.TERMINAL_STATES:
            return info
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout:.0f} s "
                               f"(reason: {info.get('Reason')})")
        time.sleep(poll_s)
