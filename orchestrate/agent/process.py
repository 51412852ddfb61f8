"""torchrun's agent as a process of its own, started before planning (`python -m orchestrate.agent
REPLY_FD`, by orchestrate.transports.local.agent): while the launcher plans and writes the run directory,
it imports what every worker needs (torch, torchrun, the worker's code, the model's transformers
code); then it runs the launcher's torchrun argument list with the workers forked from it
(torchrun's `start_method="fork"`), so no worker imports any of that again.

Why: `import torch` plus the model's transformers code is most of a small run's time to step 1, and
a spawned torchrun worker pays it again after the launcher paid for torch; started this way the
chain is one import, overlapped with planning (docs/measurements.md#agentprocesspy).
Why a process and not the launcher itself: a forked worker inherits its parent's state, and the
launcher has threads (progress bar, output pumps) and may have asked CUDA whether a GPU is there
(`LocalTorchrun.check`); the agent has done neither when it forks (it never calls CUDA).

Input, on stdin, one JSON object per line:
  1. {"config": <RunConfig as plan.json has it>, "source_dir": ...}: what to import;
  2. {"argv": [...], "env": {...}}: the torchrun arguments (exactly launch.sh's) and the library
     settings the launcher would add to torchrun's environment (launch.session.launch_env).
End of input before 2: nothing to run (the launch was refused); exit 0.
Output: {"code": N, "messages": [...]} on REPLY_FD; torchrun's and rank 0's output on stdout/stderr.
The workers still get only the plan file's path (the program of argv).
"""

from __future__ import annotations

import gc
import json
import multiprocessing.popen_fork  # noqa: F401  (torchrun's fork start)
import multiprocessing.queues  # noqa: F401
import os
import signal
import sys
from pathlib import Path

from orchestrate.agent.torchrun import run_torchrun, stopped
from orchestrate.config.load import config_from_dict
from orchestrate.run.exits import EX_TEMPFAIL, STOP_SIGNALS
from orchestrate.worker import forked
from orchestrate.worker.forked import import_worker_modules
from orchestrate.worker.orphans import guard_parent
from orchestrate.worker.preload import import_model_code


def _read_message() -> dict | None:
    line = sys.stdin.readline()
    return json.loads(line) if line.strip() else None


def import_worker_code(config_data: dict, source_dir: str | None) -> None:
    """Import what a worker of this config imports before its first step (a failure is left for the
    worker, which imports again and reports it)."""
    try:
        import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401
        import torch.distributed.launcher.api  # noqa: F401
        import torch.distributed.run  # noqa: F401

        import_worker_modules()
        import_model_code(config_from_dict(config_data, Path(source_dir) if source_dir else None))
    except Exception:  # noqa: BLE001 - see the docstring
        pass


class _Stops:
    """The agent's stop signals, from its first moment. The first one counts, later ones are ignored:
    a signal can come twice here (SLURM or a process-group kill reaches this process directly and
    through the launcher's forwarding), and a second one would cut torchrun's grace period for the
    workers' checkpoint short. Before torchrun runs, a signal is only noted (the run is then not
    started: exit 75, nothing to checkpoint); once `armed`, it raises torchrun's SignalException, which
    stops the workers (torchrun's own handler does just that; it is replaced by this one, by name:
    torchrun's PContext.start installs `_terminate_process_handler`)."""

    def __init__(self) -> None:
        self.first: signal.Signals | None = None
        self.armed = False

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handle)

    def handle(self, signum: int, frame: object) -> None:
        if self.first is not None:
            return
        self.first = signal.Signals(signum)
        if self.armed:
            from torch.distributed.elastic.multiprocessing.api import SignalException

            if forked.BOARD is not None:
                if forked.BOARD.all_done:  # after the last step: torchrun collects the finished ranks, exit 0
                    return
                forked.BOARD.stopping()  # ranks that finish from now on leave at once (worker/forked.py)
            raise SignalException(f"Process {os.getpid()} got signal: {self.first}", sigval=self.first)

    def arm(self) -> None:
        import torch.distributed.elastic.multiprocessing.api as pcontext

        pcontext._terminate_process_handler = self.handle
        self.armed = True


def main(reply_fd: int) -> int:
    stops = _Stops()
    stops.install()
    guard_parent()  # the launcher's SIGKILL leaves no agent (and so no workers: they guard this one)
    first = _read_message()
    if first is None:
        return 0
    # No cyclic garbage collection while the workers' modules import (it finds next to nothing there
    # and costs a sizeable share of the import: docs/measurements.md#agentprocesspy). Then the
    # imported objects are frozen out of the collector's view, so the forked ranks neither scan them
    # nor copy their pages by touching them (gc.freeze's purpose).
    gc.disable()
    import_worker_code(first["config"], first.get("source_dir"))
    gc.freeze()
    gc.enable()
    go = _read_message()
    if go is None:
        return 0

    os.environ.update({k: v for k, v in go["env"].items() if k not in os.environ})
    messages: list[str] = []
    stops.arm()
    if stops.first is not None:  # stopped while it imported: the workers never start
        messages.append(stopped(stops.first, Path(go["run_dir"])))
        code = EX_TEMPFAIL
    else:
        code = run_torchrun(go["argv"], Path(go["run_dir"]), messages.append, fork_worker=True)
    sys.stdout.flush()
    sys.stderr.flush()
    with os.fdopen(reply_fd, "w") as reply:
        reply.write(json.dumps({"code": code, "messages": messages}) + "\n")
    return code
