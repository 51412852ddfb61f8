"""The hosts of `launch --hosts` and what runs on each, as text (pure): the hostfile, how the hosts
are reached (`SshOptions`; each host's own settings belong in the ssh config), the torchrun command
per host, the shell line sent over SSH (with the wrapper that reports the command's process group,
see `PGID_TAG`), and the equivalent OpenSSH command line for launch.sh. Running them is
`orchestrate.transports.ssh.remote`'s job.

Hostfiles are DeepSpeed's: one `HOST slots=N` per line, `#` comments and blank lines allowed.

    # two machines with 4 GPUs each
    node-a slots=4
    node-b slots=4   # an SSH config alias works as well as a name or address

The first host hosts the rendezvous. A host is checked where the hostfile is read
(`orchestrate.launch.addresses.host_problem`: no leading `-`, no shell characters; IPv6 plain or in
brackets, kept plain), and the ssh command line puts `--` before it besides. Every problem is
reported at once, with its line number."""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrate.errors import Problem, UserError
from orchestrate.launch.addresses import host_problem, plain_host, port_problem, user_problem

PGID_TAG = "__orchestrate_pgid__"
# Runs remotely (through the login shell) with the command's own interpreter: add the environment
# (argv[1], JSON; the host's own values win), lead a process group (sshd usually made one already),
# report its id, then become the command, so its exit status or signal is what SSH reports.
_WRAP = (
    "import json, os, sys\n"
    "for k, v in json.loads(sys.argv[1]).items():\n"
    "    os.environ.setdefault(k, v)\n"
    "if os.getpgrp() != os.getpid():\n"
    "    os.setsid()\n"
    "print('{tag}', os.getpgrp(), flush=True)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


@dataclass(frozen=True)
class NodeCommand:
    host: str
    rank: int
    """Position in the hostfile; 0 hosts the rendezvous."""
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    """Environment added on the host (unless set there already)."""


def node_commands(hosts: Sequence[Host], *, python: str, addresses: Sequence[str], rdzv_endpoint: str,
                  rdzv_id: str, program: Sequence[str], torchrun_args: Sequence[str] = (),
                  env: Mapping[str, str] | None = None) -> list[NodeCommand]:
    """torchrun on every host, as many processes as the host has slots. `addresses`: each host's
    address as the launcher resolved it (the ssh config's HostName), which the other hosts reach."""
    if not Path(python).is_absolute():
        raise UserError("remote commands need an absolute interpreter path", [Problem(
            "--python", f"{python!r}", "give the full path of the python that has orchestrate installed")])
    return [NodeCommand(host.name, rank, (
        python, "-m", "torch.distributed.run", f"--nnodes={len(hosts)}",
        f"--nproc-per-node={host.slots}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}", f"--rdzv-conf=is_host={int(rank == 0)}",
        # Where the workers' store lives when this host is the rendezvous' rank 0
        # (launcher.launch_env), rather than the host's own FQDN guess.
        f"--local-addr={address}", *torchrun_args, *program),
        tuple(sorted((env or {}).items())))
        for rank, (host, address) in enumerate(zip(hosts, addresses, strict=True))]


def remote_command(argv: Sequence[str], env: Sequence[tuple[str, str]] = ()) -> str:
    """The shell line sent over SSH for `argv` with `env` added (see `_WRAP`); argv[0] is an
    absolute interpreter."""
    return "exec " + shlex.join([argv[0], "-c", _WRAP.format(tag=PGID_TAG), json.dumps(dict(env)), *argv])


def ssh_command_line(command: NodeCommand, options: SshOptions) -> str:
    """`ssh ... HOST 'env K=V python -m torch.distributed.run ...'` for OpenSSH's client: the command
    by hand (launch.sh), without the process-group wrapper `run_on_hosts` needs to stop it."""
    argv = ["ssh"]
    if options.ssh_config:
        argv += ["-F", str(options.ssh_config)]
    if options.user:
        argv += ["-l", options.user]
    if options.port:
        argv += ["-p", str(options.port)]
    if options.key_filename:
        argv += ["-i", options.key_filename]
    if options.known_hosts:
        argv += ["-o", f"UserKnownHostsFile=~/.ssh/known_hosts {options.known_hosts}"]
    env = [f"{k}={v}" for k, v in command.env]
    # `--`: whatever the host is called, ssh reads it as the destination, never as an option.
    return shlex.join([*argv, "--", command.host, shlex.join(["exec", "env", *env, *command.argv])])


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


_SLOTS = re.compile(r"^slots=(?P<n>\S*)$")
_SSH_SPLITS = re.compile(r"[\s\"'\\%]")
"""What ssh_config values split at (whitespace, quotes, backslash) or expand (% tokens)."""


@dataclass(frozen=True)
class Host:
    name: str
    """A host name, address or SSH config alias (user@ and :port are not part of it)."""
    slots: int
    """Processes (GPUs) to start on this host."""
    line: int


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    hosts: list[Host] = []
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        name, *rest = line.split()
        if "@" in name or name.count(":") == 1 or "]:" in name:
            problems.append(Problem(where, f"{name!r}: user and port do not belong in the hostfile",
                                    "put them in ~/.ssh/config (Host alias / User / Port) or use --ssh-user/--ssh-port"))
            continue
        bad_name = host_problem(name)
        if bad_name:
            problems.append(Problem(where, bad_name, "a name, an address or an ssh config alias, e.g. `node-a slots=4`"))
            continue
        name = plain_host(name)
        slots = _SLOTS.match(rest[0]) if len(rest) == 1 else None
        if not slots:
            problems.append(Problem(where, f"expected `HOST slots=N`, got {line!r}", "e.g. `node-a slots=4`"))
            continue
        value = slots["n"]
        if not value.isdigit() or int(value) < 1:
            problems.append(Problem(where, f"slots={value} is not a positive whole number", "e.g. slots=4"))
            continue
        if name in seen:
            problems.append(Problem(where, f"{name} is listed twice (first on line {seen[name]})",
                                    "one line per host; slots= counts its processes"))
            continue
        seen[name] = number
        hosts.append(Host(name=name, slots=int(value), line=number))
    if not hosts and not problems:
        problems.append(Problem(source, "no hosts in the file", "one `HOST slots=N` line per machine"))
    if problems:
        raise UserError(f"cannot read the hostfile {source}", problems)
    return hosts


def load_hostfile(path: Path) -> list[Host]:
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError("cannot read the hostfile", [Problem("--hosts", f"{path}: {e.strerror}")]) from None
    return parse_hostfile(text, str(path))


@dataclass(frozen=True)
class SshOptions:
    user: str | None = None
    port: int | None = None
    key_filename: str | None = None
    ssh_config: Path | None = None
    """An ssh_config file to use instead of ~/.ssh/config and /etc/ssh/ssh_config."""
    known_hosts: Path | None = None
    """Trusted host keys in addition to ~/.ssh/known_hosts and the ssh config's UserKnownHostsFile."""
    trust_on_first_use: bool = False
    connect_timeout: float = 15
    stop_grace_s: float | None = None
    """SIGTERM to SIGKILL when stopping a host's command; None: DEFAULT_STOP_GRACE_S."""

    def __post_init__(self) -> None:
        """UserError listing every flag that could not be written into an ssh command line as the one
        value it is: a user or port out of its rule (`orchestrate.launch.addresses`), a known_hosts
        path that ssh would split at whitespace or expand at % (`-o UserKnownHostsFile=...`)."""
        problems = []
        if self.user is not None and (bad := user_problem(self.user)):
            problems.append(Problem("--ssh-user", bad, "the login name on the hosts, or leave it to the ssh config"))
        if self.port is not None and (bad := port_problem(self.port)):
            problems.append(Problem("--ssh-port", bad, "sshd's port on the hosts, usually 22"))
        if self.known_hosts is not None and _SSH_SPLITS.search(str(self.known_hosts)):
            problems.append(Problem("--known-hosts", f"{str(self.known_hosts)!r} has whitespace, a quote, \\ or %, "
                                    "which ssh reads as more than a file name", "use a path without them (a symlink)"))
        if problems:
            raise UserError("cannot reach the hosts with these SSH settings", problems)
