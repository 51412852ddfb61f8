"""Step callbacks: what happens around each optimizer step besides the step itself.

The step loop (`orchestrate.worker.loop`) calls every callback of the run in order, on every rank:
`on_train_start` once, `on_step_end` after each optimizer step with that step's record (the line
metrics.jsonl gets: step, loss, lr, grad_norm, tokens, tokens_per_s, step_time_s, memory measured
and predicted, eval_loss on evaluation steps), `on_train_end` once when the loop ends (done or
stopped early). Callbacks that only observe (metrics file, trackers, progress) act on rank 0 and
return at once elsewhere; collective ones (evaluation, checkpoints, stop signals) act on every rank
alike. A callback that wants the loop to stop returns True from `on_step_end`.

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


class StepCallback(Protocol):
    def on_train_start(self, run: RunInfo) -> None: ...

    def on_step_end(self, run: RunInfo, record: dict[str, Any]) -> bool | None:
        """`record`: this step's metrics (see the module docstring); True asks the loop to stop."""
        ...

    def on_train_end(self, run: RunInfo, stopped_early: bool) -> None: ...
