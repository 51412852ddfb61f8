"""Chunked cross-entropy (`train.loss_chunks`): the causal-LM loss without the full b x s x V logits.

The model runs through its wrapper (DDP's hooks, FSDP's unshard) with `logits_to_keep=1`, so its own
LM head projects one position only; a forward hook on the decoder captures the final hidden states
(after the last norm). The LM head + cross-entropy then run on one chunk of the sequence at a time,
each under non-reentrant `torch.utils.checkpoint`: the forward keeps only the chunk's hidden states
(a view) and backward recomputes that chunk's logits, so one chunk's logits exist at a time (the
planner's term: planner/knobs.py). The same loss as transformers' `ForCausalLMLoss` (labels shifted
left, -100 ignored, fp32 logits, mean over the counted tokens), as torchtune's
CEWithChunkedOutputLoss and Liger's fused linear cross-entropy compute it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

IGNORE = -100  # transformers' ignore_index for labels


def _chunk_loss(hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
    import torch.nn.functional as F

    logits = head(hidden).float()  # fp32 like ForCausalLMLoss (upcast before the softmax)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor,
                          chunks: int) -> torch.Tensor:
    """Mean next-token cross-entropy of `head(hidden)` against `labels` (b x s, unshifted)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(hidden.chunk(chunks, dim=1), shifted.chunk(chunks, dim=1), strict=True):
        total = total + checkpoint(_chunk_loss, h, y, head, use_reentrant=False)
    return total / (shifted != IGNORE).sum().clamp(min=1)


def chunked_causal_lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunks: int) -> torch.Tensor:
    """The causal-LM loss of one batch, its LM head + cross-entropy in `chunks` chunks (module doc)."""
    hf = getattr(model, "module", model)  # DDP keeps the model in .module; FSDP2 and peft forward attributes
    captured: list[torch.Tensor] = []
    hook = hf.get_decoder().register_forward_hook(lambda _m, _a, out: captured.append(out[0]))
    try:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        model(**inputs, use_cache=False, logits_to_keep=1)  # the model's own head: one position
    finally:
        hook.remove()
    if hasattr(model, "unshard"):
        # FSDP2 reshards the root unit (embeddings, final norm, LM head) when its forward returns; the
        # chunks call the LM head after that, and recompute it in backward: gather it again. The root's
        # post-backward (FSDP2's final backward callback) reduce-scatters its gradients and reshards it.
        model.unshard()
    return chunked_cross_entropy(captured[-1], hf.get_output_embeddings(), batch["labels"], chunks)
