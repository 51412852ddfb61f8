"""Where the reference's answer log-probabilities come from on a worker (config.py `placement`):

- adapter: the trained model itself with its LoRA adapters disabled (peft `disable_adapter`), in eval
  mode for that forward: the frozen base, as TRL computes the reference of a peft model;
- replicated / sharded / offload: a frozen copy of the reference model, built at its placement like
  any auxiliary model (orchestrate/loading/auxiliary.py), run on the same batch;
- precomputed: read from the first pass's files (cache.py) by the batch's `record_index`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from orchestrate.methods.preference.losses import AnswerLogps
from orchestrate.methods.preference.objective import ReferenceLogps, answer_logps


def peft_model(model: torch.nn.Module) -> torch.nn.Module:
    """The peft model inside a DDP wrapper or a DeepSpeed engine (FSDP2 shards it in place)."""
    inner = getattr(model, "module", model)
    if not hasattr(inner, "disable_adapter"):
        raise TypeError(f"{type(inner).__name__} has no adapters to disable")  # internal: planned for LoRA only
    return inner


@contextmanager
def _evaluating(model: torch.nn.Module):
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def adapter_reference() -> ReferenceLogps:
    """The trained model with its adapters disabled (no dropout, no activation recompute: eval mode)."""
    def logps(model: torch.nn.Module, batch: dict) -> AnswerLogps:
        with peft_model(model).disable_adapter(), _evaluating(model):
            return answer_logps(model, batch)

    return logps


def module_reference(reference: torch.nn.Module) -> ReferenceLogps:
    """A frozen reference module (collective when sharded: every rank calls it once per micro-batch)."""
    def logps(model: torch.nn.Module, batch: dict) -> AnswerLogps:
        return answer_logps(reference, batch)

    return logps
