"""The reference model on a worker, where the plan's chosen candidate places it
(`Candidate.reference_placement`, searched by the planner: memory.py), before the trained model is built
(as distillation's teacher: methods/distill/build.py builds both):

- adapter: nothing to build: the trained model with its adapters disabled (reference.py);
- replicated / sharded / offload: a frozen copy of `preference.reference`, or of the model's initial
  weights when it is null (the SFT run's RUN_DIR/model, or the weights a model built from its config
  starts from: the same directory the trained model loads);
- precomputed: the first pass (cache.py) with the reference held as lean as the ranks allow, then
  freed: training reads RUN_DIR/reference_logps.
Returns the reference's log-probabilities for training batches and for evaluation batches (the
precomputed ones are read from each split's own table).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from orchestrate.data.pipeline import TrainData
    from orchestrate.methods.preference.objective import ReferenceLogps
    from orchestrate.planner.plan import Plan


References = tuple["ReferenceLogps | None", "ReferenceLogps | None"]
"""(the reference for training batches, for evaluation batches)."""


def reference_placement(plan: Plan, device: torch.device, world_size: int) -> str:
    """The placement this worker builds: the plan's (auto resolved as the planner would for a pinned
    strategy: adapter with LoRA, else replicated), offload on a CPU device and sharded over one rank as
    replicated (nothing to offload from or to split)."""
    placement = plan.chosen.reference_placement or plan.config.preference.placement
    if placement == "auto":
        placement = "adapter" if plan.config.train.method in ("lora", "qlora") else "replicated"
    if (placement == "offload" and device.type == "cpu") or (placement == "sharded" and world_size == 1):
        return "replicated"
    return placement


def reference_dir(plan: Plan, run_dir: Path, local_rank: int) -> Path:
    """preference.reference, or the model's initial weights (collective: they may be written first)."""
    from orchestrate.loading.init_weights import ensure_initial_weights

    if plan.config.preference.reference is not None:
        return plan.config.resolve_path(plan.config.preference.reference)
    return ensure_initial_weights(plan, run_dir, local_rank)


def build_reference(plan: Plan, run_dir: Path, data: TrainData, device: torch.device, rank: int, local_rank: int,
                    world_size: int) -> References:
    """The reference for training and for evaluation batches; (None, None) for orpo."""
    from orchestrate.methods.distill.build import build_frozen
    from orchestrate.methods.preference.config import REFERENCE_FREE
    from orchestrate.methods.preference.reference import adapter_reference, module_reference

    if plan.config.preference.loss in REFERENCE_FREE:
        return None, None
    placement = reference_placement(plan, device, world_size)
    if placement == "adapter":
        return adapter_reference(), adapter_reference()
    path = reference_dir(plan, run_dir, local_rank)
    if placement != "precomputed":
        live = module_reference(build_frozen(plan, path, device, world_size, placement))
        return live, live
    from orchestrate.methods.preference.cache import identity, is_complete, precomputed_reference, write_reference_logps

    views = {"train": data.train, "validation": data.validation}
    expected = identity(plan.config, views, path, plan.chosen.strategy.precision, run_dir)
    if not is_complete(run_dir, expected):  # a resumed run with the same data and reference reuses the files
        lean = "offload" if device.type == "cuda" else "sharded" if world_size > 1 else "replicated"
        reference = build_frozen(plan, path, device, world_size, lean)
        write_reference_logps(run_dir, expected, views, reference, device, rank, world_size,
                              plan.chosen.strategy.micro_batch_size)
        del reference  # freed before the trained model is built: the point of precomputing
    return precomputed_reference(run_dir, "train"), precomputed_reference(run_dir, "validation")
