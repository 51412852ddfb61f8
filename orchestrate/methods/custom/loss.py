"""How your own module (`model.module`) is called on a batch and what its loss is (`train.loss`).

A batch is a dict of tensors. Samples that were tuples (inputs..., label) arrive with their
inputs under the positional keys "_0", "_1", ... (orchestrate.methods.custom.data), passed to the
model in that order; any other key except `labels` is a keyword argument. With `train.loss: model`
the labels are passed too and the output's own `loss` (key or attribute) is the loss;
`cross_entropy` is `torch.nn.functional.cross_entropy(logits, labels)`, where the logits are the
output itself or its `logits`; `auto` takes the model's loss when its output has one.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

LABELS = "labels"
POSITIONAL = "_"
"""Prefix of the keys of tuple inputs: "_0", "_1", ..."""


def call(model: Any, batch: dict[str, torch.Tensor], with_labels: bool) -> Any:
    args = [batch[k] for k in sorted((k for k in batch if k.startswith(POSITIONAL)), key=lambda k: int(k[1:]))]
    kwargs = {k: v for k, v in batch.items() if not k.startswith(POSITIONAL) and (with_labels or k != LABELS)}
    return model(*args, **kwargs)


def _field(output: Any, name: str) -> Any:
    if isinstance(output, dict):
        return output.get(name)
    return getattr(output, name, None)


def logits_of(output: Any) -> torch.Tensor | None:
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return _field(output, "logits")


def _model_loss_wanted(model: Any, batch: dict[str, torch.Tensor], mode: str) -> tuple[Any, bool]:
    """(output, whether its own loss is the loss)."""
    if mode == "cross_entropy" or (mode == "auto" and not takes_labels(model)):
        return call(model, batch, with_labels=False), False
    output = call(model, batch, with_labels=mode == "auto" or takes_labels(model))
    return output, mode == "model" or _field(output, "loss") is not None


def takes_labels(model: Any) -> bool:
    """Whether the module's forward accepts `labels` (by name or **kwargs); wrappers are looked through."""
    from torch import nn

    inner = model
    while isinstance(getattr(inner, "module", None), nn.Module):
        inner = inner.module  # DDP and DeepSpeed engines hold the user's module as .module
    try:
        params = inspect.signature(inner.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == LABELS or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def loss_and_output(model: Any, batch: dict[str, torch.Tensor], mode: str) -> tuple[torch.Tensor, Any]:
    """The scalar loss of one batch under `train.loss` mode, and the model's output."""
    import torch.nn.functional as F

    output, own = _model_loss_wanted(model, batch, mode)
    if own:
        loss = _field(output, "loss")
        if loss is None:
            raise TypeError("train.loss is model, but the module's output has no `loss` key or attribute")
        return loss, output
    logits = logits_of(output)
    if logits is None or LABELS not in batch:
        raise TypeError("train.loss cross_entropy needs a tensor output (or `logits`) and `labels` in the batch")
    return F.cross_entropy(logits.float(), batch[LABELS]), output
