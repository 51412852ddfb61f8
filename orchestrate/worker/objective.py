"""Objectives: what a batch's loss is. An engine calls `objective.loss(model, batch)` on every
micro-batch (training and evaluation) and backpropagates the loss it returns; the metrics go to
the step's record. Today's objective is the causal-LM loss; masked LM, classification and
distillation plug in here (one class each, named in `_OBJECTIVES`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from orchestrate.planner.plan import Plan


class Objective(Protocol):
    name: str

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The scalar loss of one micro-batch (already on the model's device)."""
        ...


class CausalLMObjective:
    """Next-token cross-entropy as the Hugging Face model computes it from `labels` (shifted inside
    the model: `ForCausalLMLoss` in transformers' loss_utils)."""

    name = "causal-lm"

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # use_cache=False: a KV cache is useless in training and clashes with activation checkpointing.
        return model(**batch, use_cache=False).loss


_OBJECTIVES = {"causal-lm": CausalLMObjective}


def objective_for(plan: Plan) -> Objective:
    """The objective of the plan's task (every plan trains a causal LM today)."""
    return _OBJECTIVES["causal-lm"]()
