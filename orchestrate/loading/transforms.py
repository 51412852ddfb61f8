"""Model transforms: what changes the model after it is built and before the backend wraps it
(adapters, quantized bases, pruning masks). Each is one class in one file, named in
`_TRANSFORMS`; `apply_transforms` runs those the plan asks for, in order. lora.py: LoRA / QLoRA
adapters (`train.method`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from orchestrate.methods.lora.transform import LoraTransform

if TYPE_CHECKING:
    import torch

    from orchestrate.planner.plan import Plan


class ModelTransform(Protocol):
    name: str

    def applies(self, plan: Plan) -> bool:
        """Whether the plan asks for this transform."""
        ...

    def apply(self, model: torch.nn.Module, plan: Plan) -> torch.nn.Module:
        """The transformed model (may be the same object). Runs on every rank alike."""
        ...


_TRANSFORMS: tuple[type[ModelTransform], ...] = (LoraTransform,)


def transforms_for(plan: Plan) -> list[ModelTransform]:
    return [t for t in (cls() for cls in _TRANSFORMS) if t.applies(plan)]


def apply_transforms(model: torch.nn.Module, plan: Plan) -> torch.nn.Module:
    """Every backend calls this between building the module and wrapping it."""
    name_the_causal_lm_loss(model, plan)
    for transform in transforms_for(plan):
        model = transform.apply(model, plan)
    return model


def name_the_causal_lm_loss(model: torch.nn.Module, plan: Plan) -> None:
    """transformers picks a model's loss from its class name; a causal LM named otherwise
    (GPT2LMHeadModel) gets `loss_type` None, falls back to ForCausalLM and warns "`loss_type=None` was
    set in the config but it is unrecognized" (modeling_utils.py `loss_function`) at its first loss.
    The same loss, named, without the warning."""
    if plan.config.model.task == "causal-lm" and getattr(model, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"
