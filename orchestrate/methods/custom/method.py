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
from orchestrate.errors import Problem, UserError
from orchestrate.methods.spec import Method, MethodTerms
from orchestrate.model.shape import ModelShape


class ModuleTerms(MethodTerms):
    """Your own module: its loss is its own (never chunked); without repeated block classes there is
    nothing to recompute."""

    splits_sequence = False  # its objective reads whole sequences (the worker refuses a sequence split)
    chunks_loss = False

    def __init__(self, shape: ModelShape) -> None:
        self.blocks = bool(shape.block_classes)

    def recompute_options(self, pinned: bool | str) -> list[bool] | None:
        if self.blocks:
            return None
        if pinned is True:
            raise UserError("Cannot plan this run", [Problem(
                "train.activation_checkpointing", "model.module has no repeated block class to recompute",
                "name the blocks in strategy.wrap: [ClassName], or set activation_checkpointing: false")])
        return [False]


class Custom(Method):
    name = "custom"
    base = True
    runtime = "orchestrate.methods.custom.runtime"
    data = "orchestrate.methods.custom.train_data"

    def active(self, config: RunConfig) -> bool:
        return config.model.module is not None

    def terms(self, config: RunConfig, shape: ModelShape, auxiliary: dict[str, ModelShape]) -> MethodTerms:
        return ModuleTerms(shape)

    def report(self, plan: Any) -> tuple[list[str], dict[str, Any]]:
        """Where the activation term came from: measured, not a formula."""
        source = "model.example_input" if plan.config.model.example_input is not None else "data.module"
        note = (f"activations of {plan.config.model.module}: measured on fake tensors, one micro-batch of {source} "
                f"({plan.shape.activation_bytes_per_sample:,} B/sample + {plan.shape.activation_bytes_fixed:,} B, fp32; "
                "methods/custom/activations.py)")
        return [note], {"activations_source": note}


CUSTOM = Custom()
