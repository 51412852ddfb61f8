"""Pruning while training (`prune:`, docs/pruning.md): magnitude or structured, on Zhu & Gupta's
gradual schedule. An add-on method that composes with full fine-tuning only: LoRA / QLoRA freeze the
weights it would zero (orchestrate/methods/spec.py).

Its files: config.py (`prune:`), schedule.py (the schedule, the pruned weights, the checks, the
saved model's size), memory.py (its masks' terms), masks.py (the masks on each rank's weights),
callback.py (the step callback), shrink.py (the smaller saved model of a structured run), runtime.py
(the worker half).
"""

from __future__ import annotations

from typing import Any

from orchestrate.config.schema import RunConfig
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.hardware.units import parameter_count
from orchestrate.methods.prune.config import PruneSection
from orchestrate.methods.prune.memory import mask_memory
from orchestrate.methods.prune.schedule import check_prune, prune_summary
from orchestrate.methods.spec import Method
from orchestrate.model.shape import ModelShape
from orchestrate.planner.memory import shard_group_size
from orchestrate.planner.plan import PlanResult
from orchestrate.planner.strategy import Strategy
from orchestrate.planner.terms import MethodTerms, PlacedBytes, PricedTerms


def mask_terms(prune: PruneSection, shape: ModelShape) -> MethodTerms:
    """A pruning plan: one bool mask per pruned weight as each rank holds it, and a mask update's scratch."""

    def priced(terms: MethodTerms, hw: HardwareProfile, strategy: Strategy, seq_len: int,
               accumulation: int) -> PricedTerms:
        own = PlacedBytes()
        for key, value in mask_memory(shape, strategy, shard_group_size(hw, strategy), prune).items():
            own.on_gpu(key, value)
        return PricedTerms(own=own)

    return MethodTerms(gpu_keys=("prune_masks", "prune_scratch"), priced=priced)


class Prune(Method):
    name = "prune"
    bases = ("full",)
    runtime = "orchestrate.methods.prune.runtime"

    def active(self, config: RunConfig) -> bool:
        return config.prune is not None

    def terms(self, config: RunConfig, shape: ModelShape, hw: HardwareProfile,
              auxiliary: dict[str, ModelShape]) -> MethodTerms:
        check_prune(config, shape)  # the composition included: a frozen base is refused there
        return mask_terms(config.prune, shape)

    def report(self, plan: PlanResult) -> tuple[list[str], dict[str, Any]]:
        p = prune_summary(plan.shape, plan.config.prune)
        line = (f"pruning ({p['method']}, {p['scope']}): {p['target_sparsity']:.0%} of {parameter_count(p['pruned_weights'])} "
                f"weights; saved model {parameter_count(p['saved_parameters'])} parameters")
        return [line], {"prune": p}


PRUNE = Prune()
