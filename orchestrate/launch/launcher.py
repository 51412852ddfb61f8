"""Plan, prepare the run directory and start the workers through torchrun's own launcher.

Library API (what `orchestrate launch` calls):

    launch_from_config(config, hardware, *, name="run", run_dir=None, dry_run=False,
                       max_restarts=0, master_addr=None, master_port=None, rdzv_backend=None,
                       rdzv_endpoint=None, rdzv_id=None, nnodes=None, node_rank=None,
                       console=None) -> LaunchResult

  plans (`make_plan`; no feasible strategy -> UserError before anything starts), writes the run
  directory (`rundir.prepare_run`) and, unless `dry_run`, runs the workers and waits. `name` is the
  YAML file's stem (run directories are `<train.output_dir>/<name>-<timestamp>`); `run_dir`
  overrides the directory. Notices (CPU-only runs, NCCL workarounds) and the torchrun command are
  printed on `console` (a rich Console) as they happen and returned in `LaunchResult.messages`.
  `LaunchResult.exit_code` is None for a dry run, else 0 or the failing worker's exit code.

    launch(plan_path, options=LaunchOptions(), console=None) -> int

  runs an already prepared RUN_DIR/plan.json (e.g. one written by `orchestrate config`).

The launcher hands the workers nothing but the plan file path: no ORCHESTRATE_* variables.
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.errors import Problem, UserError
from orchestrate.launch.rundir import LOG_DIR, PLAN_FILE, default_run_dir, prepare_run, read_run_info
from orchestrate.launch.torchrun_args import LaunchOptions, format_command, torchrun_argv
from orchestrate.planner.plan import Plan

if TYPE_CHECKING:
    from rich.console import Console

    from orchestrate.config.schema import RunConfig
    from orchestrate.hardware.profile import HardwareProfile

LAUNCH_SCRIPT = "launch.sh"


@dataclass
class LaunchResult:
    plan: Plan
    run_dir: Path
    plan_path: Path
    command: str
    """The exact equivalent `torchrun ...` command (with the environment it adds)."""
    messages: list[str] = field(default_factory=list)
    exit_code: int | None = None
    """None for a dry run."""


def _say(console: Console | None, messages: list[str], text: str) -> None:
    messages.append(text)
    if console is not None:
        console.print(text, markup=False, highlight=False)


def require_feasible(plan: Plan) -> None:
    """UserError (exit 2) naming why the closest candidates do not fit, when nothing fits."""
    if plan.chosen is not None:
        return
    closest = sorted(plan.candidates, key=lambda c: c.memory.gpu_total)[:3]
    raise UserError("no strategy fits this model on this hardware", [
        Problem(c.name, c.reason or "does not fit") for c in closest],
        details="try more GPUs or nodes, CPU/NVMe offload, a shorter train.seq_len, or a smaller micro batch; "
                "`orchestrate plan` shows every candidate")


def build_plan(config: RunConfig, hardware: HardwareProfile) -> Plan:
    from orchestrate.model.meta import shape_for
    from orchestrate.planner.search import make_plan

    plan = make_plan(config, hardware, shape_for(config))
    require_feasible(plan)
    return plan


def _write_launch_script(run_dir: Path, command: str) -> None:
    path = run_dir / LAUNCH_SCRIPT
    path.write_text(f"#!/bin/sh\n# The exact command `orchestrate launch` ran for this run.\n"
                    f"cd {shlex.quote(os.getcwd())}\n{command}\n")
    path.chmod(0o755)


def launch_from_config(config: RunConfig, hardware: HardwareProfile, *, name: str = "run",
                       run_dir: Path | None = None, dry_run: bool = False, max_restarts: int = 0,
                       master_addr: str | None = None, master_port: int | None = None,
                       rdzv_backend: str | None = None, rdzv_endpoint: str | None = None,
                       rdzv_id: str | None = None, nnodes: int | None = None, node_rank: int | None = None,
                       console: Console | None = None) -> LaunchResult:
    from orchestrate.data.pipeline import check_data_config

    plan = build_plan(config, hardware)
    check_data_config(config, plan.shape.max_position_embeddings, plan.shape.vocab_size)
    options = LaunchOptions(max_restarts=max_restarts, master_addr=master_addr, master_port=master_port,
                            rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                            nnodes=nnodes, node_rank=node_rank)
    if not dry_run:
        _require_devices(plan)
    run_dir = (run_dir or default_run_dir(config, name)).resolve()
    plan = prepare_run(plan, run_dir)
    plan_path = run_dir / PLAN_FILE
    messages: list[str] = []
    command = _announce(plan, plan_path, options, console, messages)
    result = LaunchResult(plan, run_dir, plan_path, command, messages)
    if not dry_run:
        result.exit_code = _run(plan, plan_path, options, console, messages)
    return result


def launch(plan_path: Path, options: LaunchOptions | None = None, console: Console | None = None) -> int:
    """Run the workers of a prepared run directory's plan.json; returns the exit code."""
    plan_path = Path(plan_path).resolve()
    plan = Plan.read(plan_path)
    require_feasible(plan)
    _require_devices(plan)
    options = options or LaunchOptions()
    messages: list[str] = []
    _announce(plan, plan_path, options, console, messages)
    return _run(plan, plan_path, options, console, messages)


def _require_devices(plan: Plan) -> None:
    import torch

    if plan.hardware.has_gpu and not torch.cuda.is_available():
        raise UserError("this plan is for GPUs but CUDA is not available on this machine", [Problem(
            "hardware", f"planned for {plan.hardware.gpus_per_node} x {plan.hardware.gpu.name}",
            "run it on that machine (`orchestrate config` writes the run directory without starting), "
            "or plan for CPU processes here")])


def _announce(plan: Plan, plan_path: Path, options: LaunchOptions, console: Console | None,
              messages: list[str]) -> str:
    """Print the notices and the command; returns the command (also written to launch.sh)."""
    run_dir = plan_path.parent
    argv = torchrun_argv(plan, plan_path, options, run_dir / LOG_DIR)
    info = read_run_info(plan_path)
    env = info.get("env", {})
    if not plan.hardware.has_gpu:
        n = plan.hardware.ranks_per_node
        _say(console, messages, f"No GPU on this machine: running {n} CPU process{'es' if n != 1 else ''} per node "
                                "with the gloo backend (slow; meant for trying things out and tests).")
    for note in info.get("env_notes", []):
        _say(console, messages, f"NCCL: {note}")
    command = format_command(argv, env)
    _write_launch_script(run_dir, command)
    _say(console, messages, f"strategy {plan.chosen.name}; run directory {run_dir}")
    _say(console, messages, f"command: {command}")
    return command


@contextmanager
def _environment(env: dict[str, str]):
    """Add `env` for the workers (torchrun copies os.environ); the user's own values win."""
    added = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _run(plan: Plan, plan_path: Path, options: LaunchOptions, console: Console | None,
         messages: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from orchestrate.launch.follow import follow_metrics

    argv = torchrun_argv(plan, plan_path, options, plan_path.parent / LOG_DIR) if False else _argv_from_script(plan_path)
    env = read_run_info(plan_path).get("env", {})
    stop = threading.Event()
    with _environment(env), follow_metrics(plan, plan_path.parent, console, stop):
        try:
            run(parse_args(argv))
        except ChildFailedError as exc:
            rank, failure = min(exc.failures.items())
            logs = Path(failure.error_file).parent if failure.error_file else plan_path.parent / LOG_DIR
            _say(console, messages, f"worker rank {rank} failed with exit code {failure.exitcode}; "
                                    f"its output: {logs}")
            return failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        except KeyboardInterrupt:
            return 130
    return 0
