"""The memory of pruning masks, per rank (the prune method's own terms, method.py). Pure.

The worker (orchestrate/methods/prune/masks.py) keeps one bool mask (1 byte per element, torch.bool)
per pruned weight, shaped like the weight *as this rank holds it*: FSDP2's DTensor shard (both fsdp
stages shard the parameters) and ZeRO-3's partition are 1/n of it; DDP and ZeRO-0/1/2 hold full
parameters on every rank, so the masks are replicated too. (torch.nn.utils.prune instead keeps an
fp32 mask buffer plus an fp32 weight_orig copy, 8 bytes per element, replicated.)
"""

from __future__ import annotations

from orchestrate.backends.registry import shards_parameters
from orchestrate.methods.prune.config import PruneSection
from orchestrate.methods.prune.schedule import prunable_linears
from orchestrate.model.shape import ModelShape
from orchestrate.planner.strategy import Strategy

MASK_BYTES = 1
"""torch.bool is one byte per element (torch/csrc: c10::ScalarType::Bool)."""

SCRATCH_BYTES = 4 + 1
"""A mask update holds, for the largest pruned weight at a time, |w| as fp32 (4 B, its bits compared
as int32) and one bool comparison (1 B): prune_masks.py's threshold search."""


def mask_memory(shape: ModelShape, strategy: Strategy, shard_group: int, prune: PruneSection) -> dict[str, float]:
    """prune_masks: every pruned element's mask as this rank holds it; prune_scratch: the transient
    of one mask update."""
    linears = prunable_linears(shape, prune)
    div = shard_group if shards_parameters(strategy.sharding) else 1
    elements = shape.num_layers * sum(i * o for _, i, o in linears)
    largest = max((i * o for _, i, o in linears), default=0)
    return {"prune_masks": MASK_BYTES * elements / div, "prune_scratch": SCRATCH_BYTES * largest / div}
