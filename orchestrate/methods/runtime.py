"""The worker half of a training method (orchestrate/methods/spec.py states the composition rule):
`MethodRuntime`, whose module `Method.runtime` names (it defines `RUNTIME`; the registry imports it
on the worker only). Its hooks, in the order the worker's recipe (worker/main.py) calls them:

- `auxiliary`: the method's auxiliary models, built at their placements before the trained model
  (orchestrate/loading/auxiliary.py); what it returns is handed to `objective`.
- `build_model` (a base method): the model the backend wraps, as its `ModelRequest`
  (orchestrate/backends/base.py) asks, with the method's model transforms applied (`transform`,
  every active method's, in hook order).
- `objective`: the training objective, given the task's (an objective method wraps it).
- `callbacks`: its step callbacks (their `phase` places them: orchestrate/worker/callbacks/base.py).
- `save`: what it writes when training is done, from the engine's consolidated state
  (`TrainEngine.model_state`): a base method the model (model/: as it trains, or its adapters merged
  into the re-read base, and the adapter beside it); an add-on, after its base (registry order), what
  it changes or adds (a smaller pruned model); and the lines the done message adds.
  `saves_tokenizer`: whether model/ gets the tokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from orchestrate.backends.base import BuiltModel, ModelRequest, Objective, TrainEngine
    from orchestrate.backends.rank import Rank
    from orchestrate.data.pipeline import TrainData
    from orchestrate.planner.plan import RunPlan
    from orchestrate.run.layout import RunDir
    from orchestrate.worker.callbacks.base import Callback


class MethodRuntime:
    """No-op hooks; a method's runtime overrides what it does on the worker."""

    saves_tokenizer = True
    """model/ gets the run's tokenizer (your own module has none)."""

    def auxiliary(self, plan: RunPlan, rank: Rank, run: RunDir, data: TrainData) -> Any:
        return None

    def build_model(self, plan: RunPlan, request: ModelRequest) -> BuiltModel:
        raise NotImplementedError(f"{type(self).__name__} is not a base method: it builds no model")

    def transform(self, model: torch.nn.Module, plan: RunPlan) -> torch.nn.Module:
        """The model changed between building and wrapping (runs on every rank alike)."""
        return model

    def objective(self, plan: RunPlan, task: Objective, auxiliary: Any) -> Objective:
        return task

    def callbacks(self, plan: RunPlan) -> list[Callback]:
        return []

    def save(self, plan: RunPlan, engine: TrainEngine, run: RunDir, rank: Rank) -> list[str]:
        """Collective: called on every rank, in hook order, when training is done; returns the done
        message's lines (rank 0's count)."""
        return []
