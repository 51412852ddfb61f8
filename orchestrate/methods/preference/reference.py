"""Where the reference's answer log-probabilities come from on a worker (config.py `placement`):

- adapter: the trained model itself with its LoRA adapters disabled (peft `disable_adapter`), its
  dropout off for that forward: the frozen base, as TRL computes the reference of a peft model (TRL
  turns dropout off for the whole run: DPOConfig.disable_dropout). The model stays in training mode,
  so the reference runs the kernels the model's own forward runs (bitsandbytes' CPU NF4 layer takes
  another path in eval mode unless it is switched off: methods/lora/transform.py; before that switch a
  QLoRA reference differed from the model at step 1);
- replicated / sharded / offload: a frozen copy of the reference model, built at its placement as
  any auxiliary model (runtime.py, orchestrate/loading/auxiliary.py `build_frozen`), run on the same batch;
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
def without_dropout(model: torch.nn.Module):
    """Dropout off in `model` for the block (the reference's forward, a rollout's sampling), restored after."""
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    rates = [m.p for m in dropouts]
    for m in dropouts:
        m.p = 0.0
    try:
        yield
    finally:
        for m, p in zip(dropouts, rates, strict=True):
            m.p = p


def adapter_reference(chunks: int = 0) -> ReferenceLogps:
    """The trained model with its adapters disabled and no dropout (under no_grad: nothing recomputed);
    `chunks`: train.loss_chunks (objective.answer_logps)."""
    def logps(model: torch.nn.Module, batch: dict) -> AnswerLogps:
        with peft_model(model).disable_adapter(), without_dropout(model):
            return answer_logps(model, batch, chunks)

    return logps


def module_reference(reference: torch.nn.Module, chunks: int = 0) -> ReferenceLogps:
    """A frozen reference module (collective when sharded: every rank calls it once per micro-batch)."""
    def logps(model: torch.nn.Module, batch: dict) -> AnswerLogps:
        return answer_logps(reference, batch, chunks)

    return logps
