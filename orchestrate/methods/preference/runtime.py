"""Preference tuning on the worker: the reference where the plan's chosen candidate places it
(`Candidate.placements["reference"]`, searched by the planner), built before the trained model
(orchestrate/loading/auxiliary.py, as distillation's teacher):

- adapter: nothing to build: the trained model with its adapters disabled (reference.py);
- replicated / sharded / offload: a frozen copy of `preference.reference`, or of the model's initial
  weights when it is null (the SFT run's RUN_DIR/model, or the weights a model built from its config
  starts from: the same directory the trained model loads);
- precomputed: the first pass (cache.py) with the reference held as lean as the ranks allow, then
  freed: training reads RUN_DIR/reference_logps.
Then the preference objective (objective.py) fed by it, in place of the task's, and the step's rewards
(callback.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from orchestrate.backends.base import Objective
from orchestrate.backends.rank import Rank
from orchestrate.data.pipeline import TrainData
from orchestrate.loading.auxiliary import build_frozen, lean_placement, placement_on
from orchestrate.loading.init_weights import ensure_initial_weights
from orchestrate.methods.preference.cache import (
    identity,
    is_complete,
    precomputed_reference,
    records_read,
    write_reference_logps,
)
from orchestrate.methods.preference.callback import PreferenceMetrics
from orchestrate.methods.preference.config import REFERENCE_FREE
from orchestrate.methods.preference.memory import REFERENCE
from orchestrate.methods.preference.objective import PreferenceObjective, ReferenceLogps
from orchestrate.methods.preference.reference import adapter_reference, module_reference
from orchestrate.methods.runtime import MethodRuntime
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import RunDir
from orchestrate.worker.callbacks.base import Callback

References = tuple[ReferenceLogps, ReferenceLogps]
"""(the reference for training batches, for evaluation batches: a precomputed one reads each split's table)."""


def reference_placement(plan: RunPlan, device: torch.device, world_size: int) -> str:
    """The placement this worker builds: the plan's (auto for a strategy pinned by hand: adapter under
    LoRA with the model's own weights as reference, else as any auxiliary model's)."""
    section = plan.config.preference
    if (plan.chosen.placements.get(REFERENCE) is None and section.placement == "auto"
            and plan.config.train.method in ("lora", "qlora") and section.reference is None):
        return "adapter"
    return placement_on(plan, REFERENCE, section.placement, device, world_size)


def reference_dir(plan: RunPlan, run: RunDir, local_rank: int) -> Path:
    """preference.reference, or the model's initial weights (collective: they may be written first)."""
    if plan.config.preference.reference is not None:
        return plan.config.resolve_path(plan.config.preference.reference)
    return ensure_initial_weights(plan, run.path, local_rank)


class PreferenceRuntime(MethodRuntime):
    def auxiliary(self, plan: RunPlan, rank: Rank, run: RunDir, data: TrainData) -> References | None:
        """The reference for training and for evaluation batches; None for simpo and orpo."""
        if plan.config.preference.loss in REFERENCE_FREE:
            return None
        placement = reference_placement(plan, rank.device, rank.world_size)
        chunks = plan.strategy.loss_chunks  # a live reference's forward chunked as the model's
        if placement == "adapter":
            return adapter_reference(chunks), adapter_reference(chunks)
        path = reference_dir(plan, run, rank.local_rank)
        if placement != "precomputed":
            live = module_reference(build_frozen(plan, path, rank.device, rank.world_size, placement), chunks)
            return live, live
        views = {"train": data.train, "validation": data.validation}
        records = records_read(views, data.blocks_read(plan.config.train))
        expected = identity(plan.config, views, records, path, plan.strategy.precision, run.path)
        if not is_complete(run.path, expected):  # a resumed run with the same data and reference reuses the files
            reference = build_frozen(plan, path, rank.device, rank.world_size,
                                     lean_placement(rank.device, rank.world_size))
            write_reference_logps(run.path, expected, views, records, reference, rank.device, rank.rank,
                                  rank.world_size, plan.strategy.micro_batch_size)
            del reference  # freed before the trained model is built: the point of precomputing
        return precomputed_reference(run.path, "train"), precomputed_reference(run.path, "validation")

    def objective(self, plan: RunPlan, task: Objective, auxiliary: References | None) -> Objective:
        # In place of the task's: the losses compare answer log-probabilities of whole sequences.
        train, evaluation = auxiliary if auxiliary is not None else (None, None)
        return PreferenceObjective(plan.config.preference, train, evaluation, plan.strategy.loss_chunks)

    def callbacks(self, plan: RunPlan) -> list[Callback]:
        return [PreferenceMetrics()]


RUNTIME = PreferenceRuntime()
