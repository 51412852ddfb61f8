"""What runs on each host, as text (pure): the torchrun command per host of a hostfile, the shell
line sent over SSH (with the wrapper that reports the command's process group, see `PGID_TAG`),
and the equivalent OpenSSH command line for launch.sh. Running them is `orchestrate.transports.ssh.remote`'s job.
"""

from __future__ import annotations

import ipaddress
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.errors import Problem, UserError
from orchestrate.transports.ssh.hostfile import Host

if TYPE_CHECKING:
    from orchestrate.transports.ssh.options import SshOptions

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
    return shlex.join([*argv, command.host, shlex.join(["exec", "env", *env, *command.argv])])


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
