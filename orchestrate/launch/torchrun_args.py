"""The torchrun argument list for a plan, built once: `--dry-run` prints it as a `torchrun ...`
command, and the launcher runs the very same list through `torch.distributed.run`.

Output: every rank's stdout/stderr goes to RUN_DIR/logs/<rdzv-id>_*/attempt_<n>/<local rank>/ and
local rank 0's is also shown live (torchrun's --redirects / --tee).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from orchestrate.errors import Problem, UserError
from orchestrate.launch.addresses import endpoint_problem, host_problem, port_problem
from orchestrate.planner.plan import RunPlan
from orchestrate.ports import free_port
from orchestrate.run.layout import LOG_DIR, WORKER_MODULE, worker_program

_DEFAULT_MULTINODE_RDZV_ID = "orchestrate"


HAND_MADE_RENDEZVOUS = ("master_addr", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "node_rank")
"""The rendezvous options beyond the port: any of them given, the user launches across nodes by hand."""


@dataclass(frozen=True)
class LaunchOptions:
    """torchrun's rendezvous and restart options (`orchestrate launch`'s flags, passed through) and
    what it runs; None means orchestrate's default."""

    max_restarts: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    """Single node: the rendezvous port (default: a free one). Multi-node: the static rendezvous port."""
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    nnodes: int | None = None
    """Default: the plan's node count."""
    node_rank: int | None = None
    """Static (master-addr) rendezvous across nodes only."""
    worker_module: str = WORKER_MODULE
    """What torchrun runs with `-m`: the worker, or a wrapper that ends in it (a benchmark's, say)."""
    program: tuple[str, ...] = ()
    """The user's own training program (`launch -- python train.py ARGS`, normalised by
    `launch.user_program`), run under the plan instead of the worker; () runs the worker."""

    def __post_init__(self) -> None:
        """UserError listing every rendezvous flag outside its rule (`orchestrate.launch.addresses`):
        checked here, where the flags come in, so no launch path meets a port of 99999 or a host
        that reads as an option."""
        checks = [("--master-port", self.master_port, port_problem), ("--master-addr", self.master_addr, host_problem),
                  ("--rdzv-endpoint", self.rdzv_endpoint, endpoint_problem)]
        problems = [Problem(flag, bad) for flag, value, rule in checks if value is not None and (bad := rule(value))]
        if problems:
            raise UserError("cannot use these rendezvous settings", problems)

    @property
    def hand_made_rendezvous(self) -> dict[str, object]:
        """The HAND_MADE_RENDEZVOUS options given, by field name: none for a launch orchestrate places
        (here, over SSH, in a SLURM allocation)."""
        return {k: v for k in HAND_MADE_RENDEZVOUS if (v := getattr(self, k)) is not None}


def torchrun_argv(plan: RunPlan, plan_path: Path, options: LaunchOptions, log_dir: Path) -> list[str]:
    """torchrun's arguments (without the program name) that run `python -m orchestrate.worker plan_path`."""
    nnodes = options.nnodes or plan.hardware.nodes
    if nnodes != plan.hardware.nodes:
        raise UserError("node count does not match the plan", [Problem(
            "--nnodes", f"{nnodes} given, the plan is for {plan.hardware.nodes}", "re-plan with --nodes")])
    argv = ["--nnodes", str(nnodes), "--nproc-per-node", str(plan.hardware.ranks_per_node)]
    one_node = nnodes == 1 and not options.rdzv_endpoint and not options.master_addr
    if one_node and (options.rdzv_backend == "static" or (options.rdzv_backend is None and not options.max_restarts)):
        # One node, no restarts: torchrun's static rendezvous, its store on a free local port (concurrent
        # runs never collide on 29500). Not c10d: its dynamic rendezvous waits a random 0-0.3 s before
        # joining and walks the stack with inspect.stack() for every event it records (torch/distributed/
        # elastic/rendezvous/dynamic_rendezvous.py), a visible share of the start-up. With --max-restarts,
        # c10d: after a restart under the static one the new group met the old group's store and gloo
        # could not connect, as pytorch/pytorch#135712 (why: docs/measurements.md#launchtorchrun_argspy).
        # --local-addr: where rank 0 hosts the workers' store (launch_env), not the FQDN.
        port = options.master_port or free_port()
        argv += ["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port),
                 "--local-addr", "127.0.0.1"]
    elif one_node:
        port = options.master_port or free_port()  # c10d (or the backend asked for), on a free local port
        argv += ["--rdzv-backend", options.rdzv_backend or "c10d", "--local-addr", "127.0.0.1",
                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", options.rdzv_id or plan_path.parent.name]
    elif options.rdzv_endpoint:
        argv += ["--rdzv-backend", options.rdzv_backend or "c10d", "--rdzv-endpoint", options.rdzv_endpoint,
                 "--rdzv-id", options.rdzv_id or _DEFAULT_MULTINODE_RDZV_ID]
    elif options.master_addr:
        if options.node_rank is None:
            raise UserError("multi-node launch needs this node's rank", [Problem(
                "--node-rank", "missing", "give --node-rank 0 on the master node, 1.. on the others")])
        argv += ["--node-rank", str(options.node_rank), "--master-addr", options.master_addr,
                 "--master-port", str(options.master_port or 29500)]
    else:
        raise UserError("multi-node launch needs a rendezvous point", [Problem(
            "--rdzv-endpoint", f"the plan spans {nnodes} nodes but no rendezvous was given",
            "pass --rdzv-endpoint HOST:PORT (same on every node), or --master-addr HOST --node-rank N")])
    if options.node_rank is not None and "--node-rank" not in argv:
        argv += ["--node-rank", str(options.node_rank)]
    argv += ["--max-restarts", str(options.max_restarts),
             "--log-dir", str(log_dir), "--redirects", "3", "--tee", "0:3",
             *worker_program(plan_path, options.worker_module, options.program)]
    return argv


def worker_torchrun_args(run_dir: Path, max_restarts: int = 0) -> tuple[str, ...]:
    """torchrun options every node of a multi-node job gets: per-rank logs under RUN_DIR/logs (each
    node's torchrun makes its own subdirectory), local rank 0's output echoed (the `--tee` of a
    local launch)."""
    return ("--max-restarts", str(max_restarts), "--log-dir", str(run_dir / LOG_DIR),
            "--redirects", "3", "--tee", "0:3")


TEED_PREFIX = "[default0]:"
"""torchrun's prefix on the lines it tees: local rank 0's (`--tee 0:3`; role "default"), the one rank
a node shows. With one rank shown it tells nothing (SSH output says the host and node already), so
the launcher prints those lines without it; the other ranks' output is in their log files."""


def without_teed_prefix(line: str) -> str:
    return line[len(TEED_PREFIX):] if line.startswith(TEED_PREFIX) else line


def format_command(argv: list[str], env: dict[str, str] | None = None) -> str:
    """The shell command equivalent to running `argv` through torchrun with `env` added."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items()))
    return (prefix + " " if prefix else "") + shlex.join(["torchrun", *argv])
