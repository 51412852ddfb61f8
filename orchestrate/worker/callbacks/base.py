"""Step callbacks: what happens around each optimizer step besides the step itself.

The step loop (`orchestrate.worker.loop.run_loop`) calls every callback of the run on every rank:
`on_train_start` once, `on_step_end` after each optimizer step with a `StepEnd`, `on_train_end` once
when the loop ends (done, stopped early or failed). `Callback` has no-op hooks; a callback overrides
the ones it needs and declares its `phase`, which fixes its place in the order (the loop sorts by
phase, callbacks of one phase in the order they were registered):

    WEIGHTS   changes the weights after the optimizer step (pruning): everything after sees them
    MEASURE   adds metrics to the step's record (evaluation; a method's own step metrics)
    OBSERVE   reads the record (metrics file, progress, trackers, the memory verdict)
    PERSIST   writes state (checkpoints) and says so: `StepEnd.checkpointed`
    STOP      ends the loop after this step: `StepEnd.stop` (stop signals), reading `checkpointed`

Observers act on rank 0 only and return at once elsewhere; the others are collective and act on
every rank alike, so every rank decides the same. Adding one = a `Callback` subclass in its own file
(a method's in its folder, returned by its runtime's `callbacks`), plus its tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from orchestrate.backends.base import TrainEngine
    from orchestrate.backends.rank import Rank
    from orchestrate.data.pipeline import TrainData
    from orchestrate.planner.plan import RunPlan
    from orchestrate.run.layout import RunDir
    from orchestrate.worker.checkpointing import Checkpointer
    from orchestrate.worker.signals import StopRequest


class Phase(IntEnum):
    WEIGHTS = 0
    MEASURE = 1
    OBSERVE = 2
    PERSIST = 3
    STOP = 4


@dataclass(frozen=True)
class Training:
    """The training in progress, as the step loop and its callbacks see it (built by the worker's stages)."""

    plan: RunPlan
    rank: Rank
    run: RunDir
    engine: TrainEngine
    data: TrainData
    checkpointer: Checkpointer
    stop: StopRequest
    start_step: int
    """0 for a fresh run, else the step of the checkpoint it resumed from."""


@dataclass
class StepEnd:
    """One finished optimizer step, as the callbacks see it: what the loop measured (`step` to
    `slowest_save_s`: read it, never change it), the record callbacks add metrics to, and the two
    flags later phases read."""

    step: int
    final: bool
    """The plan's last step (train.max_steps)."""
    stopping: bool
    """Some rank got a stop signal (agreed by all ranks)."""
    record: dict[str, Any]
    """The step's metrics.jsonl line: step, loss, lr, grad_norm, skipped, tokens, tokens_per_s,
    step_time_s, time, the measured and predicted memory (worker/loop.py `step_record`), then what
    MEASURE callbacks `add` (eval_loss, sparsity, ...)."""
    signal_waited_s: float = 0.0
    """Seconds since the earliest rank's stop signal."""
    slowest_save_s: float | None = None
    """The slowest rank's last checkpoint write (what the grace period is weighed against)."""
    checkpointed: bool = False
    """Set by a PERSIST callback that saved this step."""
    stop: bool = False
    """Set by a STOP callback: the loop ends after this step."""

    def add(self, metrics: dict[str, Any]) -> None:
        """Add metrics to the record; the loop's own entries are not replaced."""
        clash = [key for key in metrics if key in self.record]
        if clash:
            raise KeyError(f"step {self.step}: the record has {clash} already")
        self.record.update(metrics)


class Callback:
    """A step callback: no-op hooks, a phase (see the module docstring)."""

    phase: ClassVar[Phase] = Phase.OBSERVE

    def on_train_start(self, training: Training) -> None:
        """Once, before the first step (`training.start_step` + 1)."""

    def on_step_end(self, training: Training, end: StepEnd) -> None:
        """After every optimizer step."""

    def on_train_end(self, training: Training, stopped_early: bool) -> None:
        """Once, when the loop ends: done, stopped by a STOP callback, or failed."""


def in_order(callbacks: list[Callback]) -> list[Callback]:
    """The callbacks in the order the loop calls them: by phase, registration order within one."""
    return sorted(callbacks, key=lambda c: c.phase)
