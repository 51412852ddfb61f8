"""Chunked cross-entropy (`train.loss_chunks`): the causal-LM loss without the full b x s x V logits.

The model runs through its wrapper (DDP's hooks, FSDP's unshard) with `logits_to_keep=1`, so its own
LM head projects one position only; a forward hook on the decoder captures the final hidden states
(after the last norm). The LM head + cross-entropy then run on one chunk of the sequence at a time,
each under non-reentrant `torch.utils.checkpoint`: the forward keeps only the chunk's hidden states
(a view) and backward recomputes that chunk's logits, so one chunk's logits exist at a time (the
planner's term: planner/knobs.py). The same loss as transformers' `ForCausalLMLoss` (labels shifted
left, -100 ignored, fp32 logits, mean over the counted tokens), as torchtune's
CEWithChunkedOutputLoss and Liger's fused linear cross-entropy compute it.

`final_hidden_states` and `over_chunks` are that machinery for any per-chunk function of the logits
(preference tuning's answer log-probabilities: methods/preference/objective.py); under no_grad (a
reference's forward, evaluation) the chunks run without checkpoint, nothing being recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

IGNORE = -100  # transformers' ignore_index for labels

ChunkFunction = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]
"""(one chunk's logits, its targets: the labels already shifted) -> the chunk's values."""


def _cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    # fp32 like ForCausalLMLoss (upcast before the softmax)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def _head_then(fn: ChunkFunction, hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
    return fn(head(hidden), targets)


def over_chunks(fn: ChunkFunction, hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor,
                chunks: int) -> list[torch.Tensor]:
    """`fn(head(h), y)` for each of `chunks` chunks of positions (dim 1) of `hidden` and `targets`: with
    autograd on, each under non-reentrant checkpoint (backward recomputes the chunk's logits)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    pieces = zip(hidden.chunk(chunks, dim=1), targets.chunk(chunks, dim=1), strict=True)
    if not torch.is_grad_enabled():
        return [_head_then(fn, h, y, head) for h, y in pieces]
    return [checkpoint(_head_then, fn, h, y, head, use_reentrant=False) for h, y in pieces]


def chunked_cross_entropy(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, chunks: int,
                          shifted: torch.Tensor | None = None, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of `head(hidden)` against `labels` (b x s, unshifted). Under
    sequence parallelism the slice's targets come `shifted` already (the next token across the slice's
    end) and the sum is divided by the whole sequences' `tokens` (orchestrate/data/sequence_slices.py)."""
    import torch

    if shifted is None:
        shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    total = hidden.new_zeros((), dtype=torch.float32)
    for part in over_chunks(_cross_entropy_sum, hidden, head, shifted, chunks):
        total = total + part
    return total / (tokens if tokens is not None else (shifted != IGNORE).sum().clamp(min=1))


@contextmanager
def final_hidden_states(model: torch.nn.Module,
                        inputs: dict[str, torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.nn.Module]]:
    """(the final hidden states of `model` over `inputs`, its LM head), the model's own head run on
    one position only; the LM head usable inside the block (module doc)."""
    import torch

    hf = getattr(model, "module", model)  # DDP keeps the model in .module; FSDP2 and peft forward attributes
    captured: list[torch.Tensor] = []
    hook = hf.get_decoder().register_forward_hook(lambda _m, _a, out: captured.append(out[0]))
    try:
        model(**inputs, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    gathered = hasattr(model, "unshard")
    if gathered:
        # FSDP2 reshards the root unit (embeddings, final norm, LM head) when its forward returns; the
        # chunks call the LM head after that, and recompute it in backward: gather it again. The root's
        # post-backward (FSDP2's final backward callback) reduce-scatters its gradients and reshards it.
        model.unshard()
    backward = torch.is_grad_enabled()
    try:
        yield captured[-1], hf.get_output_embeddings()
    finally:
        if gathered and not backward:
            model.reshard()  # no backward to reshard it (a reference's or an evaluation's forward)


def chunked_causal_lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunks: int,
                           tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The causal-LM loss of one batch, its LM head + cross-entropy in `chunks` chunks (module doc);
    a sequence-parallel slice's over its `shift_labels`, divided by `tokens` (chunked_cross_entropy)."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    with final_hidden_states(model, inputs) as (hidden, head):
        return chunked_cross_entropy(hidden, head, batch["labels"], chunks, batch.get("shift_labels"), tokens)
