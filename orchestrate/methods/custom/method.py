"""Your own nn.Module (`model.module`, docs/custom-module.md): every weight of it trains, on your own
dataset factory (`data.module`) and loss (`train.loss`). A base method (orchestrate/methods/spec.py);
neither distillation nor pruning composes with it (both need a Hugging Face causal LM), nor LoRA.

Its files: config.py (the checks of its fields; the fields are in their sections' files), module.py
(import, build, shape on the meta device), activations.py (its activations measured on fake tensors at
plan time), loss.py, objective.py, data.py and train_data.py (your dataset), runtime.py (the worker half).
"""

from __future__ import annotations

from typing import Any

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.methods.spec import Method
from orchestrate.model.shape import ModelShape
from orchestrate.planner.plan import PlanResult
from orchestrate.planner.terms import MethodTerms

_NO_BLOCKS = Problem("train.activation_checkpointing", "model.module has no repeated block class to recompute",
                     "name the blocks in strategy.wrap: [ClassName], or set activation_checkpointing: false")


def module_terms(shape: ModelShape) -> MethodTerms:
    """Your own module: its loss is its own (never chunked) over whole sequences (the worker refuses a
    sequence split); without repeated block classes there is nothing to recompute."""
    return MethodTerms(chunks_loss=False, splits_sequence=False,
                       no_recompute=None if shape.block_classes else _NO_BLOCKS)


class Custom(Method):
    name = "custom"
    base = True
    runtime = "orchestrate.methods.custom.runtime"
    data = "orchestrate.methods.custom.train_data"

    def active(self, config: RunConfig) -> bool:
        return config.model.module is not None

    def record_noun(self, config: RunConfig) -> str:
        """Its samples are data.module's dataset items (train_data.py)."""
        return "samples"

    def terms(self, config: RunConfig, shape: ModelShape, hw: HardwareProfile,
              auxiliary: dict[str, ModelShape]) -> MethodTerms:
        return module_terms(shape)

    def report(self, plan: PlanResult) -> tuple[list[str], dict[str, Any]]:
        """Where the activation term came from: measured, not a formula."""
        source = "model.example_input" if plan.config.model.example_input is not None else "data.module"
        note = (f"activations of {plan.config.model.module}: measured on fake tensors, one micro-batch of {source} "
                f"({plan.shape.activation_bytes_per_sample:,} B/sample + {plan.shape.activation_bytes_fixed:,} B, fp32; "
                "methods/custom/activations.py)")
        return [note], {"activations_source": note}


CUSTOM = Custom()
