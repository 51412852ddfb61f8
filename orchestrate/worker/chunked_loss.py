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

All chunks run as one call of the LM head module (`over_chunks` makes the loop its forward for that
call), so the hooks an engine puts on the module wrap them. Under DeepSpeed ZeRO-3 those hooks gather
the head's partitioned parameters before the call and release them after, and around its backward
gather them again (on the outputs' gradient, before any chunk recomputes) until the hidden states'
gradient is complete; inside, each chunk calls the head's own forward, hook-free. Calling the head
module once per chunk instead fails for a frozen head (LoRA, QLoRA): the chunk's recompute in backward
gathers the weight, checkpoint keeps the parameter itself (it detaches only tensors that require
grad), and the head's post-forward hook empties it before the matmul's backward reads it (torch's
CheckpointError: recomputed [0] vs saved [V, h]). DeepSpeed's own tiled blocks did not fit:
`TiledFusedLogitsLoss` runs each chunk's backward inside the forward with a unit incoming gradient, so a
trained head's weight gradient misses engine.backward's 1/gradient_accumulation and fp16 loss scale (it
scales only the hidden states' gradient), and it yields only a scalar (preference tuning needs
per-token values); `SequenceTiledCompute` recomputes through the head module once per chunk in
backward (two gathers per chunk: its call, then its pre-backward hook) and runs a nested backward per
chunk, so a trained head's weight gradient lands once per chunk and needs DeepSpeed's
`ds_grad_is_ready` flags to be reduced once; here autograd sums the chunks' weight gradients into one
accumulation, as for any parameter used several times, and the same code runs under DDP and FSDP2.
"""

from __future__ import annotations

import functools
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


def _head_then(fn: ChunkFunction, hidden: torch.Tensor, targets: torch.Tensor,
               project: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return fn(project(hidden), targets)


def _each_chunk(fn: ChunkFunction, project: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                targets: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    import torch
    from torch.utils.checkpoint import checkpoint

    pieces = zip(hidden.chunk(chunks, dim=1), targets.chunk(chunks, dim=1), strict=True)
    if not torch.is_grad_enabled():
        return [_head_then(fn, h, y, project) for h, y in pieces]
    return [checkpoint(_head_then, fn, h, y, project, use_reentrant=False) for h, y in pieces]


def over_chunks(fn: ChunkFunction, hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor,
                chunks: int) -> list[torch.Tensor]:
    """`fn(head(h), y)` for each of `chunks` chunks of positions (dim 1) of `hidden` and `targets`: with
    autograd on, each under non-reentrant checkpoint (backward recomputes the chunk's logits). One call
    of `head`, the loop as its forward, so the module's hooks wrap every chunk (module doc)."""
    own = head.__dict__.get("forward")  # a forward set on the instance (a library's wrapper) comes back
    head.forward = functools.partial(_each_chunk, fn, head.forward)
    try:
        return head(hidden, targets, chunks)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


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
