"""Plan, prepare the run directory and start the workers through torchrun's own launcher.

Library API (what `orchestrate launch` calls):

    launch_from_config(config, hardware, *, name="run", run_dir=None, dry_run=False,
                       max_restarts=0, master_addr=None, master_port=None, rdzv_backend=None,
                       rdzv_endpoint=None, rdzv_id=None, nnodes=None, node_rank=None,
                       resume=False, console=None) -> LaunchResult

  plans (`make_plan`; no feasible strategy -> UserError before anything starts), writes the run
  directory (`rundir.prepare_run`) and, unless `dry_run`, runs the workers and waits. `name` is the
  YAML file's stem (run directories are `<train.output_dir>/<name>-<timestamp>`); `run_dir`
  overrides the directory. Notices (CPU-only runs, NCCL workarounds) and the torchrun command are
  printed on `console` (a rich Console) as they happen and returned in `LaunchResult.messages`.
  `LaunchResult.exit_code` is None for a dry run, else 0, the failing worker's exit code, or 75
  (EX_TEMPFAIL) when the workers checkpointed and stopped on a signal (RUN_DIR/REQUEUE exists).
  A `run_dir` that already holds checkpoints is refused unless `resume`: then `run_dir` (default:
  the newest run of `name`) continues from its latest checkpoint (`orchestrate.launch.resume`).

    launch(plan_path, options=LaunchOptions(), console=None) -> int

  runs an already prepared RUN_DIR/plan.json (e.g. one written by `orchestrate config`).

`prepare_run_dir` (plan or resume, check, write the run directory) and `launch_env` (the workers'
environment) are shared with the multi-node launchers (`orchestrate.launch.multinode`).

The launcher hands the workers nothing but the plan file path: no ORCHESTRATE_* variables.
"""

from __future__ import annotations

import json
import os
import shlex
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.errors import Problem, UserError
from orchestrate.launch.resume import plan_for_resume, refuse_checkpointed, resume_notice, run_to_resume
from orchestrate.launch.rundir import LOG_DIR, PLAN_FILE, default_run_dir, prepare_run, read_run_info
from orchestrate.launch.torchrun_args import LaunchOptions, format_command, torchrun_argv
from orchestrate.planner.plan import Plan

if TYPE_CHECKING:
    from collections.abc import Callable

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


def say(console: Console | None, messages: list[str], text: str, *, soft_wrap: bool = False) -> None:
    """Record `text` in `messages` and print it verbatim (no markup) on `console`; `soft_wrap`
    leaves long lines unbroken (the multi-node launchers print commands and host output)."""
    messages.append(text)
    if console is not None:
        console.print(text, markup=False, highlight=False, soft_wrap=soft_wrap)


def build_plan(config: RunConfig, hardware: HardwareProfile) -> Plan:
    from orchestrate.model.meta import shape_for
    from orchestrate.planner.search import make_plan, require_feasible

    plan = make_plan(config, hardware, shape_for(config))
    require_feasible(plan)
    return plan


def write_launch_script(run_dir: Path, comment: str, body: str) -> None:
    """RUN_DIR/launch.sh: what was run, as an executable shell script."""
    path = run_dir / LAUNCH_SCRIPT
    path.write_text(f"#!/bin/sh\n# {comment}\n{body}\n")
    path.chmod(0o755)


def prepare_run_dir(config: RunConfig, hardware: HardwareProfile, name: str, run_dir: Path | None, resume: bool,
                    say: Callable[[str], None], check: Callable[[Plan], None] | None = None) -> tuple[Plan, Path]:
    """Plan (UserError when nothing fits), check the data, run `check` on the plan, then write the
    run directory; notices (resuming) go to `say`. With `resume`, `run_dir` (default: the newest run of `name`) keeps its own plan
    when it still fits and is not written again (`orchestrate.launch.resume`); otherwise a
    `run_dir` that already holds checkpoints is refused. Returns the plan and the run directory."""
    from orchestrate.data.pipeline import check_data_config

    if resume:
        run_dir = run_to_resume(config, name, run_dir)
        plan, reused = plan_for_resume(config, hardware, run_dir)
        say(resume_notice(run_dir, reused))
    else:
        plan, reused = build_plan(config, hardware), False
        run_dir = (run_dir or default_run_dir(config, name)).resolve()
        refuse_checkpointed(run_dir)
    check_data_config(plan.config, plan.shape.max_position_embeddings, plan.shape.vocab_size)
    if check is not None:
        check(plan)
    return (plan if reused else prepare_run(plan, run_dir)), run_dir


def launch_from_config(config: RunConfig, hardware: HardwareProfile, *, name: str = "run",
                       run_dir: Path | None = None, dry_run: bool = False, max_restarts: int = 0,
                       master_addr: str | None = None, master_port: int | None = None,
                       rdzv_backend: str | None = None, rdzv_endpoint: str | None = None,
                       rdzv_id: str | None = None, nnodes: int | None = None, node_rank: int | None = None,
                       resume: bool = False, console: Console | None = None) -> LaunchResult:
    messages: list[str] = []
    plan, run_dir = prepare_run_dir(config, hardware, name, run_dir, resume,
                                    lambda text: say(console, messages, text),
                                    check=None if dry_run else _require_devices)
    options = LaunchOptions(max_restarts=max_restarts, master_addr=master_addr, master_port=master_port,
                            rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                            nnodes=nnodes, node_rank=node_rank)
    plan_path = run_dir / PLAN_FILE
    argv, command = _announce(plan, plan_path, options, console, messages)
    result = LaunchResult(plan, run_dir, plan_path, command, messages)
    if not dry_run:
        # Tokenise once, here, into the shared cache: the workers then only map it (no race, no
        # collective timeout while a large corpus is tokenised).
        from orchestrate.data.pipeline import prepare_for_plan

        say(console, messages, prepare_for_plan(plan, run_dir, progress=console is not None))
        result.exit_code = _run(plan, plan_path, argv, console, messages)
    return result


def launch(plan_path: Path, options: LaunchOptions | None = None, console: Console | None = None) -> int:
    """Run the workers of a prepared run directory's plan.json; returns the exit code."""
    from orchestrate.planner.search import require_feasible

    plan_path = Path(plan_path).resolve()
    plan = Plan.read(plan_path)
    require_feasible(plan)
    _require_devices(plan)
    options = options or LaunchOptions()
    messages: list[str] = []
    argv, _ = _announce(plan, plan_path, options, console, messages)
    return _run(plan, plan_path, argv, console, messages)


def _require_devices(plan: Plan) -> None:
    import torch

    if plan.hardware.has_gpu and not torch.cuda.is_available():
        raise UserError("this plan is for GPUs but CUDA is not available on this machine", [Problem(
            "hardware", f"planned for {plan.hardware.gpus_per_node} x {plan.hardware.gpu.name}",
            "run it on that machine (`orchestrate config` writes the run directory without starting), "
            "or plan for CPU processes here")])


def _announce(plan: Plan, plan_path: Path, options: LaunchOptions, console: Console | None,
              messages: list[str]) -> tuple[list[str], str]:
    """Print the notices and the command; returns torchrun's argv (port chosen once, here) and the
    command line (also written to launch.sh)."""
    run_dir = plan_path.parent
    argv = torchrun_argv(plan, plan_path, options, run_dir / LOG_DIR)
    info = read_run_info(plan_path)
    env = launch_env(plan, plan_path)
    if not plan.hardware.has_gpu:
        n = plan.hardware.ranks_per_node
        say(console, messages, f"No GPU on this machine: running {n} CPU process{'es' if n != 1 else ''} per node "
                                "with the gloo backend (slow; meant for trying things out and tests).")
    for note in info.get("env_notes", []):
        say(console, messages, f"NCCL: {note}")
    command = format_command(argv, env)
    write_launch_script(run_dir, "The exact command `orchestrate launch` ran for this run.",
                        f"cd {shlex.quote(os.getcwd())}\n{command}")
    say(console, messages, f"strategy {plan.chosen.name}; run directory {run_dir}")
    say(console, messages, f"command: {command}")
    return argv, command


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


def launch_env(plan: Plan, plan_path: Path) -> dict[str, str]:
    """The plan's worker environment plus torchrun's own shutdown settings: on SIGTERM (or SIGUSR1)
    torchrun forwards the signal to the workers and waits `train.preemption_grace_s` for their
    checkpoint before SIGKILL (its default is 30 s).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: by default the workers' process group shares torchrun's
    rendezvous TCPStore, whose keys outlive a restart, so after `--max-restarts` kicks in the new
    group can read the dead group's addresses and fail ("Gloo connectFullMesh ... connection
    refused") or hang in init_process_group (pytorch/pytorch#135712; seen here with torch 2.13).
    With it, each attempt's rank 0 hosts a fresh store."""
    return {**read_run_info(plan_path).get("env", {}),
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(plan.config.train.preemption_grace_s),
            "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _run(plan: Plan, plan_path: Path, argv: list[str], console: Console | None, messages: list[str]) -> int:
    from orchestrate.worker.signals import EX_TEMPFAIL, clear_requeue, read_requeue

    run_dir = plan_path.parent
    clear_requeue(run_dir)
    with _environment(launch_env(plan, plan_path)), follow_metrics(plan, run_dir, console):
        code = _run_torchrun(argv, plan_path, console, messages)
    requeue = read_requeue(run_dir)
    if requeue is not None:
        # torchrun shows a stopped worker as exit 1 (or its own signal): the marker is the truth.
        say(console, messages, f"checkpointed at step {requeue.get('step', '?')} after {requeue.get('signal')}; "
                                f"continue with `orchestrate launch CONFIG --resume --run-dir {run_dir}` "
                                f"(exit {EX_TEMPFAIL}: requeue)")
        return EX_TEMPFAIL
    return code


def _run_torchrun(argv: list[str], plan_path: Path, console: Console | None, messages: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        # The first rank to fail with its own exit code, not one torchrun then killed (SIGTERM).
        own = [kv for kv in exc.failures.items() if kv[1].exitcode > 0] or list(exc.failures.items())
        rank, failure = min(own, key=lambda kv: (kv[1].timestamp, kv[0]))
        logs = Path(failure.error_file).parent if failure.error_file else plan_path.parent / LOG_DIR
        say(console, messages, f"worker rank {rank} failed with exit code {failure.exitcode}; "
                                f"its output: {logs}")
        return failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
    except SignalException as exc:  # torchrun turns SIGINT/SIGTERM into this after stopping the workers
        say(console, messages, f"stopped by signal {exc.sigval.name}; partial results in {plan_path.parent}")
        return 128 + int(exc.sigval)
    return 0


@contextmanager
def follow_metrics(plan: Plan, run_dir: Path, console: Console | None):
    """On a terminal, a rich progress bar fed by RUN_DIR/metrics.jsonl while the workers run
    (their own output is a log file, so rank 0 prints plain lines, shown above the bar)."""
    if console is None or not console.is_terminal:
        yield
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    total = plan.config.train.max_steps
    bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=console)
    task = bar.add_task("train", total=total, status="starting workers")
    stop = threading.Event()

    def poll() -> None:
        path, offset = run_dir / "metrics.jsonl", 0
        while not stop.wait(0.5):
            if not path.exists():
                continue
            if path.stat().st_size < offset:  # a relaunch in the same directory restarted the file
                offset = 0
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next poll
            offset += len(complete)
            for line in complete.decode().splitlines():
                rec = json.loads(line)
                status = f"loss {rec['loss']:.4f}  {rec['tokens_per_s']:,.0f} tok/s"
                bar.update(task, completed=rec["step"], status=status)

    thread = threading.Thread(target=poll, name="orchestrate-progress", daemon=True)
    with bar:
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
