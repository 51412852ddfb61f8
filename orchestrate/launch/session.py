"""The one launch sequence, whatever starts the workers:

    plan (or resume) and check -> lock the run directory (held until the workers end) -> write
    the run directory -> the workers' environment ->
    launch.sh -> tokenise the data once into the shared cache -> clear REQUEUE -> run -> exit code
    (EX_TEMPFAIL when the workers checkpointed on a stop signal; EX_OUT_OF_MEMORY when one ran out
    of device memory: re-plan with the shortfall and run again, `launch/oom_replan.py`).

A `Transport` supplies only what differs between starting torchrun here, with srun inside a SLURM
allocation, or over SSH on the hosts of a hostfile: the hardware shape it gives the plan, a check
before anything is written, the commands (and launch.sh), and how to run and stop them, and
whether its workers are the launcher's descendants (`remote_workers`: how they check the lock).

The workers get nothing but the plan file's path: no orchestrate settings in the environment.
"""

from __future__ import annotations

import shlex
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from orchestrate.errors import UserError
from orchestrate.hardware.flags import HardwareFlags
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.launch.calibration_record import record_verdict
from orchestrate.launch.oom_replan import recover
from orchestrate.launch.resume import failure_notice, resumed_data
from orchestrate.launch.rundir import prepare_run_dir
from orchestrate.methods.registry import method_data
from orchestrate.planner.plan import RunPlan
from orchestrate.run.exits import EX_OUT_OF_MEMORY, EX_TEMPFAIL, STOP_SIGNALS
from orchestrate.run.layout import (
    LAUNCH_SCRIPT,
    PLAN_FILE,
    clear_oom_records,
    clear_requeue,
    read_oom_records,
    read_requeue,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from orchestrate.config.schema import RunConfig


@dataclass(frozen=True)
class LaunchRequest:
    """What the user asked for; the transport decides where it runs."""

    config: RunConfig
    hardware: HardwareFlags | HardwareProfile = HardwareFlags()
    """Flags are shaped by the transport (a hostfile's hosts and slots, an allocation's nodes); a
    resolved profile is used as it is."""
    name: str = "run"
    """The YAML file's stem: run directories are `<train.output_dir>/<name>-<timestamp>`."""
    run_dir: Path | None = None
    resume: bool = False
    dry_run: bool = False
    max_restarts: int = 0
    force: bool = False
    """Write into a non-empty directory that is not a run directory when nothing there would be
    replaced (orchestrate.run.layout)."""
    program: tuple[str, ...] = ()
    """`launch -- python train.py ARGS`: the user's own loop brings its own data, so the data
    section is neither checked nor tokenised (the transport runs the program: LaunchOptions.program)."""


@dataclass(frozen=True)
class Prepared:
    """A transport's commands for one run directory."""

    command: str
    """The exact equivalent command, with the environment it adds."""
    script: str
    """The body of launch.sh."""
    script_comment: str
    notices: list[str] = field(default_factory=list)
    """Printed after the run directory is written, before anything runs."""


class Transport(Protocol):
    remote_workers: bool
    """True when the workers are not descendants of this process (srun, SSH): how the workers check
    the run directory's lock (orchestrate.run.lock)."""

    def hardware(self, flags: HardwareFlags) -> HardwareFlags:
        """The flags with the shape this transport runs on (nodes, ranks per node)."""
        ...

    def intro(self) -> list[str]:
        """Lines printed before planning."""
        ...

    def check(self, plan: RunPlan) -> None:
        """UserError when the plan cannot run this way; called before the run directory is written
        (not for dry runs)."""
        ...

    def warm_up(self, config: RunConfig) -> AbstractContextManager:
        """Entered before planning a launch that will run (not a dry run), left when it ends: what may
        start before the plan exists (the local transport starts torchrun's agent, which imports the
        workers' code meanwhile)."""
        ...

    def prepare(self, plan: RunPlan, run_dir: Path, env: dict[str, str], max_restarts: int,
                dry_run: bool) -> Prepared:
        ...

    def run(self, plan: RunPlan, run_dir: Path, say: Callable[[str], None], console: Console | None) -> int:
        """Start the workers of the last `prepare` and wait; returns their exit code."""
        ...


@dataclass
class LaunchResult:
    plan: RunPlan
    run_dir: Path
    plan_path: Path
    command: str
    """The exact equivalent command (with the environment it adds), as in launch.sh."""
    messages: list[str] = field(default_factory=list)
    exit_code: int | None = None
    """None for a dry run."""


def shows_progress(console: Console | None) -> bool:
    """Progress bars only on a terminal: in a pipe, a CI log or a SLURM output file each redraw is a line."""
    return console is not None and console.is_terminal


def say(console: Console | None, messages: list[str], text: str) -> None:
    """Record `text` in `messages` and print it verbatim (no markup, long lines unbroken so
    commands stay copyable) on `console`."""
    messages.append(text)
    if console is not None:
        console.print(text, markup=False, highlight=False, soft_wrap=True)


def write_launch_script(run_dir: Path, comment: str, body: str) -> None:
    """RUN_DIR/launch.sh: what was run, as an executable shell script."""
    path = run_dir / LAUNCH_SCRIPT
    path.write_text(f"#!/bin/sh\n# {comment}\n{body}\n")
    path.chmod(0o755)


def launch_env(plan: RunPlan) -> dict[str, str]:
    """The plan's worker environment plus torchrun's own shutdown settings: on SIGTERM (or SIGUSR1)
    torchrun forwards the signal to the workers and waits `train.preemption_grace_s` for their
    checkpoint before SIGKILL (its default is 30 s).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: by default the workers' process group shares torchrun's
    rendezvous TCPStore, whose keys outlive a restart, so after `--max-restarts` kicks in the new
    group can read the dead group's addresses and fail ("Gloo connectFullMesh ... connection
    refused") or hang in init_process_group (pytorch/pytorch#135712; docs/measurements.md#launchsessionpy).
    With it, each attempt's rank 0 hosts a fresh store."""
    return {**(plan.run.env if plan.run else {}),
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(plan.config.train.preemption_grace_s),
            "PET_SIGNALS_TO_HANDLE": ",".join(sig.name for sig in STOP_SIGNALS),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def env_prefix(env: dict[str, str]) -> str:
    """`K=V ...` for a shell command line, sorted."""
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))


def describe(plan: RunPlan) -> str:
    hw = plan.hardware
    what = f"{hw.gpus_per_node} GPU(s)" if hw.has_gpu else f"{hw.cpu_processes} CPU process(es) (gloo)"
    return f"{hw.nodes} node(s) x {what}: {plan.world_size} ranks; strategy {plan.chosen.name}"


def requeue_code(run_dir: Path, code: int, say: Callable[[str], None]) -> int:
    """EX_TEMPFAIL when the workers checkpointed on a stop signal (RUN_DIR/REQUEUE), else `code`:
    torchrun shows a stopped worker as exit 1 (or its own signal), the marker is the truth."""
    requeue = read_requeue(run_dir)
    if requeue is None:
        return code
    say(f"checkpointed at step {requeue.get('step', '?')} after {requeue.get('signal')}; continue with "
        f"`orchestrate launch CONFIG --resume --run-dir {run_dir}` (exit {EX_TEMPFAIL}: requeue)")
    return EX_TEMPFAIL


class StoppedBeforeWorkers(BaseException):
    """A stop signal reached the launcher before torchrun (which handles them itself) started. A
    BaseException, as KeyboardInterrupt is: a library's `except Exception` around the data preparation
    (datasets' readers, the cache's error translation) must not turn a stop into an error or swallow it."""


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """SIGTERM/SIGHUP/SIGQUIT/SIGUSR1 raise StoppedBeforeWorkers inside (main thread only: signal.signal's rule),
    so that a stop at any point is exit 75 (nothing to checkpoint yet: the resume starts at step 0),
    not the default death by signal (143)."""
    def stop(signum: int, frame: object) -> None:
        raise StoppedBeforeWorkers(signal.Signals(signum).name)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS if sig != signal.SIGINT}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launch(request: LaunchRequest, transport: Transport, console: Console | None = None) -> LaunchResult:
    """Run the sequence of the module docstring; UserError before anything is written when the plan
    cannot run (nothing fits, bad data, no device, a checkpointed run directory without --resume)."""
    messages: list[str] = []

    def tell(text: str) -> None:
        say(console, messages, text)

    for line in transport.intro():
        tell(line)
    hw = request.hardware
    hardware = hw if isinstance(hw, HardwareProfile) else transport.hardware(hw).resolve()
    # A directory this launch makes is removed again when its data turns out unusable (see `start`).
    fresh = not request.resume and (request.run_dir is None or not Path(request.run_dir).exists())
    with ExitStack() as held:  # the run directory's lock, from before it is written until the workers end
        if not request.dry_run:
            held.enter_context(transport.warm_up(request.config))
        plan, run_dir = prepare_run_dir(request.config, hardware, request.name, request.run_dir, request.resume,
                                        tell, check=None if request.dry_run else transport.check,
                                        force=request.force, hold=held,
                                        remote_workers=transport.remote_workers, check_data=not request.program)
        return start(plan, run_dir, transport, request.max_restarts, request.dry_run, console, messages,
                     own_data=bool(request.program), fresh=fresh)


def start(plan: RunPlan, run_dir: Path, transport: Transport, max_restarts: int = 0, dry_run: bool = False,
          console: Console | None = None, messages: list[str] | None = None, own_data: bool = False,
          fresh: bool = False) -> LaunchResult:
    """The second half of `launch`, for a run directory written already (by `launch`'s first half
    or by `orchestrate config`): launch.sh, the data (not for a program with its own: `own_data`),
    and the workers until they end. `fresh`: the launch made `run_dir`, so data that cannot be used
    removes it again (nothing trained, nothing of the user's in it) before the UserError goes up."""
    messages = [] if messages is None else messages

    def tell(text: str) -> None:
        say(console, messages, text)

    prepared = transport.prepare(plan, run_dir, launch_env(plan), max_restarts, dry_run)
    write_launch_script(run_dir, prepared.script_comment, prepared.script)
    for line in prepared.notices:
        tell(line)
    result = LaunchResult(plan, run_dir, run_dir / PLAN_FILE, prepared.command, messages)
    if dry_run:
        return result
    try:
        with stop_signals_raise():
            if not own_data:
                from orchestrate.data.pipeline import prepare_for_plan

                # Tokenise once, here, into the shared cache: the workers (on every node) then only map
                # it (no race between nodes, no collective timeout while a large corpus is tokenised).
                tell(prepare_for_plan(plan, run_dir, method_data(plan.config), progress=shows_progress(console),
                                      resumed=resumed_data(run_dir)))
    except UserError:
        if fresh:
            shutil.rmtree(run_dir, ignore_errors=True)
            tell(f"removed {run_dir} again: the data below cannot be trained on, so nothing ran there")
        raise
    except StoppedBeforeWorkers as stopped:
        tell(f"stopped by {stopped} before the workers started; start it again with "
             f"`orchestrate launch CONFIG --resume --run-dir {run_dir}` (exit {EX_TEMPFAIL}: requeue)")
        result.exit_code = EX_TEMPFAIL
        return result
    result.exit_code = run_workers(plan, run_dir, transport, tell, console)
    attempt = 0
    # Out of device memory: re-plan with the shortfall and resume, up to train.oom_retries times.
    while result.exit_code == EX_OUT_OF_MEMORY and (replanned := recover(result.plan, run_dir, attempt, tell)):
        attempt += 1
        result.plan = replanned
        prepared = transport.prepare(replanned, run_dir, launch_env(replanned), max_restarts, False)
        write_launch_script(run_dir, prepared.script_comment, prepared.script)
        result.exit_code = run_workers(replanned, run_dir, transport, tell, console)
    if result.exit_code == 0 and (recorded := record_verdict(result.plan, run_dir)):
        tell(recorded)  # a GPU run's memory verdict, into this machine's calibration file
    if result.exit_code not in (0, EX_TEMPFAIL):
        tell(failure_notice(run_dir))
    return result


def run_workers(plan: RunPlan, run_dir: Path, transport: Transport, tell: Callable[[str], None],
                console: Console | None) -> int:
    """One start of the workers: their exit code as the run directory tells it (torchrun shows any
    failed worker as 1): EX_OUT_OF_MEMORY with RUN_DIR/oom records, EX_TEMPFAIL with REQUEUE."""
    clear_requeue(run_dir)
    clear_oom_records(run_dir)
    code = transport.run(plan, run_dir, tell, console)
    if read_oom_records(run_dir):
        return EX_OUT_OF_MEMORY
    return requeue_code(run_dir, code, tell)
