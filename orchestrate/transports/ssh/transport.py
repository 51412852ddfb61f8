"""Transport: over SSH, one torchrun per host of a hostfile (`remote.run_commands`), rendezvous on
the first host; one host failing stops all. Output streams as `[host:position] line`."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from orchestrate.errors import Problem, UserError
from orchestrate.hardware.flags import HardwareFlags
from orchestrate.launch.session import Prepared, describe
from orchestrate.launch.torchrun_args import LaunchOptions, worker_torchrun_args
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import LAUNCH_SCRIPT, PLAN_FILE, worker_program
from orchestrate.transports.slurm.transport import STOP_MARGIN_S
from orchestrate.transports.ssh import hosts, remote
from orchestrate.transports.ssh.hosts import Host

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from orchestrate.config.schema import RunConfig


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


def reject_with_hosts(options: LaunchOptions) -> None:
    """UserError for rendezvous flags that make no sense with --hosts (it chooses the rendezvous)."""
    clash = list(options.hand_made_rendezvous)
    if clash:
        raise UserError("--hosts chooses the rendezvous itself", [Problem(
            f"--{flag.replace('_', '-')}", "cannot be combined with --hosts",
            "leave it out (--master-port sets the rendezvous port on the first host)") for flag in clash])


@dataclass
class SshHosts:
    """`options.stop_grace_s` None: the workers' checkpoint grace plus a margin."""

    remote_workers = True  # started over SSH

    hosts: Sequence[Host]
    options: remote.SshOptions = field(default_factory=remote.SshOptions)
    python: str = sys.executable
    rdzv_port: int | None = None
    out: TextIO | None = None
    """Where the hosts' output goes (default stdout)."""
    _commands: list = field(default_factory=list, init=False, repr=False)

    def hardware(self, flags: HardwareFlags) -> HardwareFlags:
        return hardware_for_hosts(flags, self.hosts)

    def intro(self) -> list[str]:
        return []

    def check(self, plan: RunPlan) -> None:
        pass  # the hosts have the devices

    def warm_up(self, config: RunConfig) -> AbstractContextManager:
        return nullcontext()  # the workers start on other machines

    def prepare(self, plan: RunPlan, run_dir: Path, env: dict[str, str], max_restarts: int,
                dry_run: bool) -> Prepared:
        if self.options.stop_grace_s is None:
            self.options = dataclasses.replace(self.options,
                                               stop_grace_s=plan.config.train.preemption_grace_s + STOP_MARGIN_S)
        self._commands = remote.plan_commands(
            self.hosts, worker_program(run_dir / PLAN_FILE), python=self.python, options=self.options,
            torchrun_args=worker_torchrun_args(run_dir, max_restarts), rdzv_port=self.rdzv_port,
            rdzv_id=run_dir.name, env=env, probe_port=not dry_run)
        lines = [hosts.ssh_command_line(c, self.options) + " &" for c in self._commands]
        command = "\n".join([*lines, "wait"])
        endpoint = next(a.split("=", 1)[1] for a in self._commands[0].argv if a.startswith("--rdzv-endpoint="))
        return Prepared(command=command, script=command,
                        script_comment="What `orchestrate launch --hosts` ran: one torchrun per host over SSH "
                                       "(by hand, nothing stops the others when one fails).",
                        notices=[f"{describe(plan)}; run directory {run_dir} (every host must see it at this path)",
                                 f"hosts: {', '.join(h.name for h in self.hosts)}; rendezvous {endpoint}",
                                 f"commands: {run_dir / LAUNCH_SCRIPT}"])

    def run(self, plan: RunPlan, run_dir: Path, say: Callable[[str], None], console: Console | None) -> int:
        try:
            remote.run_commands(self._commands, self.options, self.out)
            return 0
        except remote.HostFailure as failure:
            say(f"error: {failure}")
            return failure.failed.exit_code if failure.failed.exit_code and failure.failed.exit_code > 0 else 1
        except KeyboardInterrupt:
            say("interrupted: stopped the workers on every host")
            return 130
