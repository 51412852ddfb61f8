"""Your own nn.Module on the worker: built and initialised by its own code (seeded alike on every
rank) for every backend, trained on your dataset factory (train_data.py) with the loss of
`train.loss`; the saved model is its state dict with its description (module.py ModuleConfig), no
tokenizer."""

from __future__ import annotations

from orchestrate.backends.base import BuiltModel, ModelRequest, Objective, TrainEngine
from orchestrate.backends.hf_io import StateLayout
from orchestrate.backends.rank import Rank
from orchestrate.methods.custom.module import ModuleConfig, build_module
from orchestrate.methods.custom.objective import CustomObjective
from orchestrate.methods.registry import apply_transforms
from orchestrate.methods.runtime import MethodRuntime
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import RunDir


class CustomRuntime(MethodRuntime):
    saves_tokenizer = False

    def build_model(self, plan: RunPlan, request: ModelRequest) -> BuiltModel:
        # Nothing to load: the module initialises itself; FSDP2 then keeps each rank's shard of those
        # weights, deepspeed.initialize casts, partitions and moves it.
        model = build_module(plan.config, request.device)
        layout = StateLayout.of(model) if request.layout != "engine" else None
        return BuiltModel(apply_transforms(model, plan), ModuleConfig(plan.config), layout)

    def objective(self, plan: RunPlan, task: Objective, auxiliary: object) -> Objective:
        return CustomObjective(plan.config.train.loss)

    def save(self, plan: RunPlan, engine: TrainEngine, run: RunDir, rank: Rank) -> list[str]:
        engine.save_hf_model(run.model)  # its state dict, and its description as config.json
        return []


RUNTIME = CustomRuntime()
