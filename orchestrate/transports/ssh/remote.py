"""Multi-host launch over SSH: one torchrun per host of a hostfile, started in parallel with fabric.

Each host runs `PYTHON -m torch.distributed.run --nnodes N --nproc-per-node SLOTS ...` with a c10d
rendezvous on the first host, which hosts the store (`is_host=1` there, 0 elsewhere: the hostname
heuristic is wrong when several hosts share an address). The rendezvous hands out the node ranks
(GROUP_RANK, sorted by host name and pid, not by hostfile order); output comes back line by line
as `[host:N] ...`, N being the host's position in the hostfile.

Stopping. Each remote command leads a process group of its own and first prints the group id. When one host's command fails (or on Ctrl-C), the others are stopped through a second SSH
session: SIGTERM to that process group (torchrun forwards it to its workers and gives them
`stop_grace_s` to exit) and, after the grace period, SIGKILL to the group and every descendant
(torchrun starts its workers in sessions of their own, so the group alone does not reach them).

Host keys are checked: the keys in ~/.ssh/known_hosts, /etc/ssh/ssh_known_hosts, the ssh config's
UserKnownHostsFile and `known_hosts` are trusted, an unknown host is refused. `trust_on_first_use`
(`--trust-new-hosts`) accepts and records unknown keys instead (paramiko's AutoAddPolicy; fabric's
default, which we override); a key that differs from a recorded one is refused either way.

Remote commands name the interpreter by absolute path (this one, unless given): a non-interactive
SSH session does not read the login files that put a virtual environment on PATH. The few library
settings the workers need (plan.json's `run.env`: OMP_NUM_THREADS, NCCL workarounds) travel in the
command itself, not through SSH's SetEnv (which sshd refuses unless AcceptEnv allows it); a value
already set on the host wins.
"""

from __future__ import annotations

import shlex
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from orchestrate.errors import Problem, UserError
from orchestrate.launch.addresses import endpoint
from orchestrate.launch.torchrun_args import without_teed_prefix
from orchestrate.transports.ssh.hosts import (
    PGID_TAG,
    Host,
    NodeCommand,
    SshOptions,
    is_loopback,
    node_commands,
    remote_command,
)

# Runs remotely with the same interpreter: stop a process group and everything it started.
_STOP = r"""
import os, signal, sys, time
pgid, grace = int(sys.argv[1]), float(sys.argv[2])

def table():
    rows = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            rows[int(d)] = (fields[0], int(fields[1]), int(fields[2]))  # state, ppid, pgrp
    return rows

def tree():
    rows = table()
    found = {p for p, (_, _, g) in rows.items() if g == pgid}
    while True:
        more = {p for p, (_, pp, _) in rows.items() if pp in found} - found
        if not more:
            return {p for p in found if rows[p][0] != "Z"}
        found |= more

def alive(pids):
    rows = table()
    return {p for p in pids if p in rows and rows[p][0] != "Z"}

procs = tree()  # before the signal: workers orphaned by a dying torchrun leave the tree
try:
    os.killpg(pgid, signal.SIGTERM)
except ProcessLookupError:
    pass
deadline = time.monotonic() + grace
while time.monotonic() < deadline and alive(procs) | tree():
    time.sleep(0.1)
left = alive(procs) | tree()
for pid in left:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
print(f"stopped process group {pgid}" + (f" (killed {len(left)} that outlived the grace period)" if left else ""))
"""
DEFAULT_STOP_GRACE_S = 30
_FREE_PORT = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"


@dataclass
class HostResult:
    host: str
    rank: int
    exit_code: int | None = None
    """None when the command never ran or its end was not reported (see `error`)."""
    error: str | None = None
    """Why it could not run: unreachable host, refused host key, failed login."""
    stopped: bool = False
    """We stopped it because another host failed or on Ctrl-C."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0


class HostFailure(Exception):
    """A host's command failed; every other host was stopped."""

    def __init__(self, failed: HostResult, results: list[HostResult]):
        self.failed, self.results = failed, results
        if failed.error is not None:
            what = f": {failed.error}"
        elif failed.exit_code == -1:  # SSH reported a signal instead of an exit status
            what = " was killed by a signal"
        else:
            what = f" exited with code {failed.exit_code}"
        stopped = [r.host for r in results if r.stopped]
        tail = f"; stopped the workers on {', '.join(stopped)}" if stopped else ""
        super().__init__(f"host {failed.host} (hostfile position {failed.rank}){what}{tail}")


class _LineWriter:
    """A file-like sink for fabric that prefixes whole lines and picks out the process group tag."""

    def __init__(self, prefix: str, emit: Callable[[str], None], on_pgid: Callable[[int], None] | None):
        self.prefix, self.emit, self.on_pgid = prefix, emit, on_pgid
        self.buffer = ""

    def write(self, data: str) -> int:
        self.buffer += data
        *lines, self.buffer = self.buffer.split("\n")
        for line in lines:
            self._line(line.rstrip("\r"))
        return len(data)

    def _line(self, line: str) -> None:
        if self.on_pgid and line.startswith(PGID_TAG):
            self.on_pgid(int(line.split()[1]))
            self.on_pgid = None
            return
        self.emit(f"{self.prefix} {without_teed_prefix(line)}")

    def flush(self) -> None:
        """Fabric flushes after each chunk; only whole lines are written (the rest at close)."""

    def close(self) -> None:
        if self.buffer:
            self._line(self.buffer)
            self.buffer = ""


# --- SSH ------------------------------------------------------------------------------------------


def connect(host: str, options: SshOptions):
    """A fabric Connection with host-key checking (see the module docstring); not yet opened."""
    import fabric
    from paramiko import AutoAddPolicy, RejectPolicy

    config = fabric.Config(runtime_ssh_path=str(options.ssh_config)) if options.ssh_config else fabric.Config()
    connect_kwargs = {"key_filename": options.key_filename} if options.key_filename else {}
    conn = fabric.Connection(host, user=options.user, port=options.port, config=config,
                             connect_timeout=options.connect_timeout, connect_kwargs=connect_kwargs)
    client = conn.client
    client.load_system_host_keys()  # ~/.ssh/known_hosts, read-only
    files = [Path("/etc/ssh/ssh_known_hosts")]
    files += [Path(p).expanduser() for p in conn.ssh_config.get("userknownhostsfile", "").split()]
    files += [options.known_hosts] if options.known_hosts else []
    for path in files:
        if path.is_file():
            client.load_system_host_keys(str(path))
    if options.trust_on_first_use:
        # Record new keys where OpenSSH would, so the next launch checks them.
        user_file = Path("~/.ssh/known_hosts").expanduser()
        user_file.parent.mkdir(mode=0o700, exist_ok=True)
        user_file.touch(mode=0o600, exist_ok=True)
        client.load_host_keys(str(user_file))
        client.set_missing_host_key_policy(AutoAddPolicy())
    else:
        client.set_missing_host_key_policy(RejectPolicy())
    return conn


def describe_ssh_error(host: str, exc: BaseException) -> str:
    from paramiko import AuthenticationException, BadHostKeyException, SSHException

    if isinstance(exc, BadHostKeyException):
        return f"host key of {host} does not match known_hosts (possible man-in-the-middle; fix known_hosts)"
    if isinstance(exc, AuthenticationException):
        return f"login to {host} refused: {exc} (check the user and key)"
    if isinstance(exc, SSHException) and "not found in known_hosts" in str(exc):
        return (f"{host} is not in known_hosts: refusing an unknown host key "
                "(ssh to it once and check the fingerprint, or pass --trust-new-hosts)")
    if isinstance(exc, (OSError, socket.timeout)):
        return f"cannot reach {host}: {exc}"
    return f"SSH to {host} failed: {type(exc).__name__}: {exc}"


def resolve_address(host: str, options: SshOptions) -> str:
    """The address SSH connects to for `host` (an ssh config alias resolves to its HostName)."""
    return connect(host, options).host


def remote_free_port(host: str, python: str, options: SshOptions) -> int:
    """A port that is free on `host` right now (chosen there: a port free here means nothing there)."""
    with connect(host, options) as conn:
        try:
            result = conn.run(shlex.join([python, "-c", _FREE_PORT]), hide=True, warn=True, in_stream=False)
        except Exception as e:  # paramiko and socket errors: all "cannot use this host"
            raise UserError("cannot start the launch", [Problem(host, describe_ssh_error(host, e))]) from None
    if result.exited != 0:
        raise UserError("cannot start the launch", [Problem(
            host, f"{python} failed there (exit {result.exited}): {result.stderr.strip()[-500:]}",
            "install orchestrate at the same path on every host, or pass its python with --python")])
    return int(result.stdout.split()[-1])


class _HostRun(threading.Thread):
    def __init__(self, command: NodeCommand, options: SshOptions, emit: Callable[[str], None],
                 done: Callable[[], None]):
        super().__init__(name=f"ssh-{command.host}", daemon=True)
        self.command, self.options, self.done = command, options, done
        self.result = HostResult(command.host, command.rank)
        self.pgid: int | None = None
        self.pgid_known = threading.Event()
        self.conn = connect(command.host, options)
        prefix = f"[{command.host}:{command.rank}]"
        self.out = _LineWriter(prefix, emit, self._set_pgid)
        self.err = _LineWriter(prefix, emit, None)

    def _set_pgid(self, pgid: int) -> None:
        self.pgid = pgid
        self.pgid_known.set()

    def run(self) -> None:
        try:
            with self.conn as conn:
                r = conn.run(remote_command(self.command.argv, self.command.env), hide=False, warn=True, pty=False,
                             in_stream=False, out_stream=self.out, err_stream=self.err)
                self.result.exit_code = r.exited
        except Exception as e:  # paramiko, socket and invoke errors: reported per host, never raised
            self.result.error = describe_ssh_error(self.command.host, e)
        finally:
            self.out.close()
            self.err.close()
            self.pgid_known.set()
            self.done()

    def stop(self, emit: Callable[[str], None]) -> None:
        """Stop the remote command (SIGTERM, grace, SIGKILL) through a second SSH session."""
        if not self.is_alive():
            return
        self.result.stopped = True
        self.pgid_known.wait(timeout=self.options.connect_timeout)
        if self.pgid is None:
            # Never got as far as reporting its group (a hung login): dropping the connection is all
            # there is to do.
            emit(f"[{self.command.host}:{self.command.rank}] not started: closing the connection")
            self.conn.close()
            return
        grace = DEFAULT_STOP_GRACE_S if self.options.stop_grace_s is None else self.options.stop_grace_s
        argv = [self.command.argv[0], "-c", _STOP, str(self.pgid), str(grace)]
        try:
            with connect(self.command.host, self.options) as conn:
                r = conn.run(shlex.join(argv), hide=True, warn=True, in_stream=False)
            emit(f"[{self.command.host}:{self.command.rank}] {r.stdout.strip() or r.stderr.strip()}")
        except Exception as e:  # the host may be the one that just went away
            emit(f"[{self.command.host}:{self.command.rank}] could not stop: {describe_ssh_error(self.command.host, e)}")


def run_on_hosts(commands: Sequence[NodeCommand], options: SshOptions = SshOptions(),
                 out: TextIO | None = None) -> list[HostResult]:
    """Run every command at once, streaming prefixed output to `out` (default stdout). The first
    failure stops all other hosts and raises HostFailure; Ctrl-C stops them all and re-raises."""
    out = out or sys.stdout
    lock = threading.Lock()
    changed = threading.Event()

    def emit(line: str) -> None:
        with lock:
            out.write(line + "\n")
            out.flush()

    runs = [_HostRun(c, options, emit, changed.set) for c in commands]
    for r in runs:
        r.start()
    failed: HostResult | None = None
    try:
        while any(r.is_alive() for r in runs):
            changed.wait(timeout=0.5)  # a timeout keeps Ctrl-C responsive in the main thread
            changed.clear()
            failed = next((r.result for r in runs if not r.is_alive() and not r.result.ok), None)
            if failed:
                _stop_all(runs, emit)
                break
    except KeyboardInterrupt:
        emit("[orchestrate] interrupted: stopping every host")
        _stop_all(runs, emit)
        raise
    for r in runs:
        r.join()
    results = [r.result for r in runs]
    failed = failed or next((r for r in results if not r.ok), None)
    if failed:
        raise HostFailure(failed, results)
    return results


def _stop_all(runs: list[_HostRun], emit: Callable[[str], None]) -> None:
    stoppers = [threading.Thread(target=r.stop, args=(emit,), daemon=True) for r in runs if r.is_alive()]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join()


def plan_commands(hosts: Sequence[Host], program: Sequence[str], *, python: str = sys.executable,
                  options: SshOptions = SshOptions(), torchrun_args: Sequence[str] = (),
                  rdzv_port: int | None = None, rdzv_id: str | None = None,
                  env: Mapping[str, str] | None = None, probe_port: bool = True) -> list[NodeCommand]:
    """The torchrun command of every host (see `node_commands`), rendezvous on the first host.

    Without `rdzv_port`, a port free on the first host is asked for there (one SSH login, which
    also checks the host key and the interpreter), or with `probe_port=False` (a dry run) written
    as the placeholder PORT. UserError when the first host cannot serve as the rendezvous."""
    if not hosts:
        raise UserError("no hosts to launch on", [Problem("--hosts", "the hostfile lists no hosts")])
    addresses = [resolve_address(h.name, options) for h in hosts]
    if is_loopback(addresses[0]) and not all(is_loopback(a) for a in addresses):
        named = "" if addresses[0] == hosts[0].name else f" (it is {addresses[0]})"
        raise UserError("the first host cannot host the rendezvous", [Problem(
            f"hostfile:{hosts[0].line}", f"{hosts[0].name}{named} is a loopback address, which the other hosts "
            "cannot reach", "name the first host by an address the others can reach")])
    if rdzv_port:
        port = str(rdzv_port)
    else:
        port = str(remote_free_port(hosts[0].name, python, options)) if probe_port else "PORT"
    return node_commands(hosts, python=python, addresses=addresses, rdzv_endpoint=endpoint(addresses[0], port),
                         rdzv_id=rdzv_id or uuid.uuid4().hex[:12], program=program, torchrun_args=torchrun_args,
                         env=env)


def run_commands(commands: Sequence[NodeCommand], options: SshOptions = SshOptions(),
                 out: TextIO | None = None) -> list[HostResult]:
    """`run_on_hosts`, then a closing line with the time it took."""
    start = time.monotonic()
    results = run_on_hosts(commands, options, out)
    (out or sys.stdout).write(f"[orchestrate] all {len(commands)} hosts finished in {time.monotonic() - start:.0f} s\n")
    return results
