"""Stop requests (SIGTERM, SIGHUP, SIGQUIT, SIGUSR1).

A signal only sets a flag: the worker finishes the step it is in (a collective cannot be left
half-way), then every rank learns of any rank's signal through the step's stats all-gather
(or `agreed`'s all-reduce), so all of them checkpoint at the same step. SLURM sends SIGTERM (preemption, `scancel`) or SIGUSR1 (`--signal`
before the time limit); torchrun forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT (and whatever
TORCHELASTIC_SIGNALS_TO_HANDLE adds, e.g. SIGUSR1) to its workers and SIGKILLs them after
TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds.

The worker then exits EX_TEMPFAIL (75) and leaves RUN_DIR/REQUEUE (`orchestrate.run.layout`).
"""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when needed: the handler is installed before torch loads (worker/main.py)
    import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
"""SIGHUP (the terminal or SSH session went away) and SIGQUIT mean what SIGTERM means: checkpoint
and exit 75. SIGINT (Ctrl-C) is not among them: it aborts (docs/fault-tolerance.md)."""


class StopRequest:
    """Records the first stop signal; `agreed()` tells every rank whether any rank got one."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received_at is None:
            self.signal_name = signal.Signals(signum).name
            self.received_at = time.monotonic()
            print(f"orchestrate: {self.signal_name}: finishing this step, then checkpoint and exit", flush=True)

    def local(self, save_s: float | None) -> tuple[float, float]:
        """This rank's (seconds since its signal or -1, its last checkpoint write time or -1): the
        values whose maxima over ranks `decide` takes (the step loop gathers them with the step's
        stats, worker/metrics.py, so a step has one collective)."""
        elapsed = time.monotonic() - self.received_at if self.received_at is not None else -1.0
        return elapsed, -1.0 if save_s is None else save_s

    @staticmethod
    def decide(longest: float, slowest: float) -> tuple[bool, float, float | None]:
        """(some rank was signalled, seconds since the earliest signal, the slowest rank's last
        checkpoint write time or None) from the maxima over ranks of `local`."""
        return longest >= 0, max(0.0, longest), None if slowest < 0 else slowest

    def agreed(self, device: torch.device, save_s: float | None) -> tuple[bool, float, float | None]:
        """`decide` on this rank's `local` values, max-reduced over ranks. Collective: one all-reduce,
        so every rank decides alike."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(self.local(save_s), dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return self.decide(*t.tolist())
