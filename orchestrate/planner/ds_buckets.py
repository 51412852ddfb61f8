"""DeepSpeed ZeRO communication settings that both the renderer and the memory model depend on.

One place decides them, so `backends/deepspeed_render.py` writes exactly what `planner/memory.py`
charges. Pure: a shape and whether the plan has GPUs in, numbers out.

Why GPU and CPU differ (measured with bench/deepspeed_settings.py, tiny GPT-2, ZeRO-2, 2 gloo
ranks, 5 interleaved rounds): with hidden^2-element buckets (16,384 elements for hidden 128, ~53
buckets for the 0.86M-parameter model) each step issues one gloo collective per bucket, and every
gloo collective costs a fixed latency on CPU. DeepSpeed's default reduce bucket (5e8 elements, the
whole model in one bucket) ran 1.24x (1.09-1.58) the tokens/s; both buckets at 5e8 1.37x
(1.23-1.59). On a GPU the bucket is an allocation on an 8 GB card (x2 with overlap_comm), hence
hidden^2 there, as Accelerate fills DeepSpeed's "auto" (accelerate/utils/deepspeed.py).
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
