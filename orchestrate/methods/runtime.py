"""The worker half of a training method (orchestrate/methods/spec.py states the composition rule):
`MethodRuntime`, whose module `Method.runtime` names (it defines `RUNTIME`; the registry imports it
on the worker only). Its hooks, in the order the worker's recipe (worker/main.py) calls them:

- `data` (a base method): the rank's training data when the method brings its own (your module's
  dataset factory); None: the token pipeline (orchestrate/data).
- `auxiliary`: the method's auxiliary models, built at their placements before the trained model
  (orchestrate/loading/auxiliary.py); what it returns is handed to `objective`.
- `build_model` (a base method): the model the backend wraps, as its `ModelRequest` asks, with the
  method's model transforms applied (`transform`, every active method's, in hook order).
- `objective`: the training objective, given the task's (an objective method wraps it).
- `callbacks`: its step callbacks (their `phase` places them: orchestrate/worker/callbacks/base.py).
- `save`: what it writes after the consolidated model (its adapter, a smaller pruned model), and
  the lines the done message adds; `saves_tokenizer`: whether model/ gets the tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from orchestrate.backends.base import Objective, TrainEngine
    from orchestrate.backends.hf_io import StateLayout
    from orchestrate.data.pipeline import TrainData
    from orchestrate.planner.plan import RunPlan
    from orchestrate.run.layout import RunDir
    from orchestrate.worker.callbacks.base import Callback
    from orchestrate.worker.rank import Rank


@dataclass(frozen=True)
class ModelRequest:
    """How a backend wants the model it wraps.

    replicated: whole on `device` in `dtype` (DDP: fp32 weights; the frozen input embedding on the
      CPU with `embedding_offload`).
    sharded: on the meta device, to be `fully_shard`ed; `BuiltModel.fill` then allocates the shards
      (on the CPU with `cpu_offload`) and reads each rank's rows (FSDP2).
    engine: for `deepspeed.initialize`, which casts, moves and partitions it: loaded whole on
      `device` in `dtype`, or, with `zero_init` (ZeRO-3's engine config), built inside
      `deepspeed.zero.Init` and loaded shard by shard into the partitions.
    """

    layout: Literal["replicated", "sharded", "engine"]
    device: torch.device
    rank: int
    model_dir: Path
    """The initial weights (config.json, and the weights unless the backend builds from the config)."""
    dtype: torch.dtype | None = None
    embedding_offload: bool = False
    cpu_offload: bool = False
    zero_init: dict[str, Any] | None = None


@dataclass
class BuiltModel:
    model: torch.nn.Module
    """Transformed (adapters...), not yet wrapped."""
    config: Any
    """What the saved model's config.json is written from: the Hugging Face config, or your module's
    description (methods/custom/module.py ModuleConfig)."""
    layout: StateLayout | None = None
    """The untransformed model's state-dict keys and ties (checkpoints, the merged export); None for an
    engine build, whose engine keeps its own."""
    fill: Callable[[torch.nn.Module], None] | None = None
    """sharded: allocate the shards and fill them, called once `fully_shard` wrapped the model."""
    keep_alive: Any = None
    """An object that must live as long as the engine (transformers' HfDeepSpeedConfig weakref)."""


class MethodRuntime:
    """No-op hooks; a method's runtime overrides what it does on the worker."""

    saves_tokenizer = True
    """model/ gets the run's tokenizer (your own module has none)."""

    def data(self, plan: RunPlan, rank: Rank, run: RunDir) -> TrainData | None:
        return None

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
        """Collective: called on every rank after the consolidated model is written; returns the done
        message's lines (rank 0's count)."""
        return []
