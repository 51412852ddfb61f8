"""Step callbacks: what happens around each optimizer step besides the step itself.

The step loop (`orchestrate.worker.loop`) calls every callback of the run in order, on every rank:
`on_train_start` once, `on_step_end` after each optimizer step with a `StepEnd` (the step, whether
it is the last one, whether some rank got a stop signal, and the step's record: the line
metrics.jsonl gets: step, loss, lr, grad_norm, tokens, tokens_per_s, step_time_s, memory measured
and predicted, eval_loss on evaluation steps), `on_train_end` once when the loop ends (done, stopped
early or failed). Callbacks that only observe (metrics file, trackers, progress) act on rank 0 and
return at once elsewhere; collective ones (evaluation, checkpoints, stop signals) act on every rank
alike, so every rank decides the same. Earlier callbacks may add to the record (evaluation adds
eval_loss) and set `checkpointed`; a callback that ends the loop sets `stop`.

Adding one = a class in one file with these three methods, plus its tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from orchestrate.planner.plan import Plan


@dataclass(frozen=True)
class RunInfo:
    """What every callback may know about the run it observes."""

    plan: Plan
    run_dir: Path
    rank: int
    world_size: int
    start_step: int
    """0 for a fresh run, else the step of the checkpoint it resumed from."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class StepEnd:
    """One finished optimizer step, as the callbacks see it."""

    step: int
    final: bool
    """The plan's last step (train.max_steps)."""
    stopping: bool
    """Some rank got a stop signal (agreed by all ranks)."""
    record: dict[str, Any]
    """This step's metrics (see the module docstring); callbacks may add to it."""
    signal_waited_s: float = 0.0
    """Seconds since the earliest rank's stop signal."""
    slowest_save_s: float | None = None
    """The slowest rank's last checkpoint write (what the grace period is weighed against)."""
    checkpointed: bool = False
    """Set by the checkpoint callback when it saved this step."""
    stop: bool = False
    """Set by a callback that ends the loop after this step."""


class StepCallback(Protocol):
    def on_train_start(self, run: RunInfo) -> None: ...

    def on_step_end(self, run: RunInfo, end: StepEnd) -> None: ...

    def on_train_end(self, run: RunInfo, stopped_early: bool) -> None: ...
