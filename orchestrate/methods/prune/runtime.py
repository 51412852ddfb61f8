"""Pruning on the worker: the masks kept by its step callback (callback.py, phase WEIGHTS), and a
structured run's saved model cut to its smaller shape (shrink.py)."""

from __future__ import annotations

from orchestrate.backends.base import TrainEngine
from orchestrate.backends.rank import Rank
from orchestrate.methods.prune.callback import Pruning
from orchestrate.methods.prune.schedule import pruned_channels, pruned_heads
from orchestrate.methods.prune.shrink import Cut, shrink_saved_model
from orchestrate.methods.runtime import MethodRuntime
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import RunDir
from orchestrate.worker.callbacks.base import Callback


class PruneRuntime(MethodRuntime):
    def callbacks(self, plan: RunPlan) -> list[Callback]:
        return [Pruning()]

    def save(self, plan: RunPlan, engine: TrainEngine, run: RunDir, rank: Rank) -> list[str]:
        prune, shape = plan.config.prune, plan.shape
        if prune.method == "structured" and rank.is_main:  # physically smaller
            shrink_saved_model(run.model, Cut(pruned_channels(shape, prune), pruned_heads(shape, prune),
                                              shape.num_kv_heads, shape.head_dim))
        return []


RUNTIME = PruneRuntime()
