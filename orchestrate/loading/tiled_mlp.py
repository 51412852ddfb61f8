"""Tiled MLP (ALST's `tiled_mlp_compute`, `Strategy.mlp_tiles`): each decoder block's MLP runs over N
slices of the sequence and is recomputed slice by slice in backward, so only one slice's
intermediate-sized tensors (gate, up, activation: micro-batch x seq_len / N x intermediate) exist at a
time; the MLP's input is all it keeps for backward.

The computation is DeepSpeed's `TiledMLP` (deepspeed/runtime/sequence_parallel/ulysses_sp.py), wired
into each MLP's forward as its docstring wires it into Hugging Face Llama's (`tiled_mlp_forward`).
It is set on the instances, never the class, so models built beside the trained one (a teacher, a
reference) keep their own forward, and before any wrapping (checkpoint_wrapper, fully_shard,
deepspeed.initialize), which then sees the tiled MLP as it would the plain one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from orchestrate.backends.hf_io import find_blocks, model_block_class_names
from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn


def decoder_mlps(model: nn.Module) -> list[nn.Module]:
    """The dense MLP (`block.mlp` of a `*MLP` class: LlamaMLP, GPT2MLP, Phi3MLP, ...) of every decoder
    block. A mixture-of-experts block's `mlp` routes tokens and returns router logits too: not one."""
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    blocks = find_blocks(model, model_block_class_names(model, model_type))
    return [block.mlp for _, block in blocks if type(getattr(block, "mlp", None)).__name__.endswith("MLP")]


def _deepspeed_tiled_mlp() -> type | None:
    """DeepSpeed's TiledMLP; None where DeepSpeed (an optional extra) is not installed or predates it."""
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    except ImportError:
        return None
    return TiledMLP


def _deepspeed_slices(tiled_mlp: type, mlp: nn.Module, plain: Callable, tiles: int) -> Callable:
    """`plain` sees contiguous slices (here and below): a slice of several sequences is a strided view,
    which GPT-2's Conv1D cannot `view`."""
    checkpointed = _checkpointed_slices(plain, tiles)

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if not hidden_states.requires_grad:
            # TiledMLP's output needs grad only if its input does (autograd does not see the parameters): with
            # a frozen embedding and adapters on the MLP alone, the first block's adapters would get none.
            return checkpointed(hidden_states)
        # TiledMLP marks the parameters ready for ZeRO's reduction in its last slice's backward, counting
        # `tiles` slices of the flattened rows, and torch.chunk may make fewer (6 rows in 4: 3 slices of 2).
        rows = hidden_states.numel() // hidden_states.shape[-1]
        slices = math.ceil(rows / math.ceil(rows / tiles))
        # Listed at each call: fully_shard and ZeRO-3 swap or gather the parameters after this is set.
        trained = [p for p in mlp.parameters() if p.requires_grad]
        return tiled_mlp.apply(lambda _mlp, x: plain(x.contiguous()), mlp, hidden_states, slices, trained)

    return forward


def _checkpointed_slices(plain: Callable, tiles: int) -> Callable:
    """The same slices, each under torch's non-reentrant checkpoint: where DeepSpeed's TiledMLP does
    not fit. (1) DDP: TiledMLP's backward runs one nested backward per slice, so each parameter's
    gradient hook fires once per slice and DDP's reducer fails ("Expected to mark a variable ready
    only once"); here autograd sums the slices' gradients before the parameter's single
    accumulation. (2) An MLP with dropout (GPT-2's `resid_pdrop`): TiledMLP recomputes without the
    forward's RNG state, so backward would draw another mask; checkpoint restores it. (3) An input
    without grad (`_deepspeed_slices`). (4) No TiledMLP installed (`_deepspeed_tiled_mlp`)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.cat([checkpoint(lambda x: plain(x.contiguous()), x, use_reentrant=False)
                          for x in hidden_states.chunk(tiles, dim=-2)], dim=-2)

    return forward


def _has_dropout(mlp: nn.Module) -> bool:
    from torch import nn

    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in mlp.modules())


def tile_mlps(model: nn.Module, tiles: int, repeated_accumulation: bool = True) -> int:
    """Make every decoder block's MLP run over `tiles` slices of the sequence; returns how many it tiled
    (none for `tiles` 0 or 1: one pass). `repeated_accumulation`: the engine takes a parameter's gradient
    accumulated once per slice within one backward (DeepSpeed ZeRO, FSDP2; DDP does not). Raises
    UserError on a model without a dense decoder MLP, so a plan that priced tiles never trains without."""
    if tiles <= 1:
        return 0
    mlps = decoder_mlps(model)
    if not mlps:
        raise UserError("train.mlp_tiles needs a decoder MLP", [Problem(
            "train.mlp_tiles", f"{type(model).__name__} has no decoder block with a dense `mlp` module to tile",
            "set train.mlp_tiles: 0")])
    tiled_mlp = _deepspeed_tiled_mlp() if repeated_accumulation else None
    for mlp in mlps:
        plain = mlp.forward
        if tiled_mlp is not None and not _has_dropout(mlp):
            mlp.forward = _deepspeed_slices(tiled_mlp, mlp, plain, tiles)
        else:
            mlp.forward = _checkpointed_slices(plain, tiles)
    return len(mlps)
