"""DeepSpeed ZeRO communication settings that both the renderer and the memory model depend on.

One place decides them, so `backends/deepspeed_render.py` writes exactly what `planner/memory.py`
charges. Pure: a shape and whether the plan has GPUs in, numbers out.

Why GPU and CPU differ: with hidden^2-element buckets each step issues one gloo collective per bucket,
and every gloo collective costs a fixed latency on CPU, so a CPU run takes the whole model in one bucket
(faster on 2 gloo ranks: docs/measurements.md#plannerds_bucketspy). On a GPU the bucket is an allocation
on an 8 GB card (x2 with overlap_comm), hence hidden^2 there, as Accelerate fills DeepSpeed's "auto" (accelerate/utils/deepspeed.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrate.planner import constants as k

if TYPE_CHECKING:
    from orchestrate.model.shape import ModelShape

DS_DEFAULT_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's own reduce_bucket_size / allgather_bucket_size default (deepspeed/runtime/zero/config.py)."""

_CPU_BUCKET_ALIGN = 2**20
"""The CPU bucket is rounded up to a multiple of this: DeepSpeed asserts allgather_bucket_size is a
multiple of its NCCL start alignment factor (stage_1_and_2.py), and a round number reads better."""


def overlap_comm(has_gpu: bool) -> bool:
    """Overlap needs a separate communication stream; a CPU-only gloo run has none, and the second
    ipg buffer it allocates (stage_1_and_2.py `setup_buckets`, "double buffers") would only cost memory."""
    return has_gpu


def bucket_elements(shape: ModelShape, has_gpu: bool) -> int:
    """reduce_bucket_size = allgather_bucket_size, in elements.

    GPU: hidden^2 (memory-bound on 8 GB cards; see module docstring). CPU: the whole model in one
    bucket (one collective per step instead of one per hidden^2 elements), at most DeepSpeed's
    default; the ipg buffer then holds at most one copy of the gradients, in host RAM."""
    if has_gpu:
        return int(k.DS_BUCKET_ELEMENTS_PER_HIDDEN_SQUARED * shape.hidden_size ** 2)
    whole = -(-shape.parameters // _CPU_BUCKET_ALIGN) * _CPU_BUCKET_ALIGN
    return min(whole, DS_DEFAULT_BUCKET_ELEMENTS)


def reduce_buffers(has_gpu: bool) -> int:
    """ipg reduce buffers of bucket_elements each DeepSpeed allocates: two with overlap_comm, else one
    (stage_1_and_2.py `setup_buckets`)."""
    return 2 if overlap_comm(has_gpu) else 1


def prefetch_elements(shape: ModelShape) -> int:
    """stage3_prefetch_bucket_size: 0.9 x hidden^2, Accelerate's "auto" (constants.py)."""
    return int(k.DS_PREFETCH_ELEMENTS_PER_HIDDEN_SQUARED * shape.hidden_size ** 2)


def stage3_reuse_distance(shape: ModelShape) -> int:
    """stage3_max_reuse_distance: two blocks' parameters.

    After each module the coordinator keeps a parameter only if it reappears in the traced module
    order before `distance` elements of other modules' parameters have gone by
    (partitioned_param_coordinator.py `__params_to_release`). Under activation checkpointing a block's
    recompute is followed by its own backward: a module's next use is at most 2 x (the block after
    it) elements away, so two blocks keep the block gathered from recompute into its backward (one
    all-gather per block saved, so two per micro-batch, as speed.py counts), while from forward into
    backward (the LM head, 2·V·h, lies between) nothing of a block is kept unless a block outweighs
    the head; the simulation gathers two blocks' worth less the head per step, with and without
    checkpointing (docs/measurements.md#plannerds_bucketspy). Larger values keep more;
    DeepSpeed's default 1e9 keeps a model under 1e9 parameters gathered from forward into backward."""
    return 2 * shape.block_parameters


def stage3_max_live(shape: ModelShape) -> int:
    """stage3_max_live_parameters: one block + one prefetch bucket.

    It caps how far the prefetcher runs ahead: each module's fetch (parameter-less modules too)
    prefetches up to min(max_live - elements gathered now, prefetch bucket) more
    (partitioned_param_coordinator.py `max_params_to_prefetch`), so gathered + in-flight parameters
    grow to max_live. Where that look-ahead reaches past the end of forward, the prefetcher finds the
    backward uses of parameters still gathered, marks them (`__most_recent_step_id_param_fetched_for`)
    and `__params_to_release` then keeps them: with DeepSpeed's 1e9 every parameter of a model under
    1e9 stays gathered from forward into backward (as the simulation shows). With one block + a bucket the look-ahead covers the next block while the blocks
    run; at the LM head (usually the largest layer, above this cap) prefetching stops, so the end of
    forward holds the head alone (docs/measurements.md#plannerds_bucketspy) and the first
    backward gather after the head is not overlapped. A smaller cap would expose gathers inside the
    blocks too."""
    return shape.block_parameters + prefetch_elements(shape)
