"""The CUDA caching allocator's reserve: device memory the allocator needs beyond the bytes tensors ask
for, from a model of c10/cuda/CUDACachingAllocator.cpp replayed over the simulation zoo
(orchestrate/simulate/allocator.py, replay.py; docs/memory-model.md).

Two parts, per backend and `expandable_segments` setting (`HardwareProfile.expandable_segments`):
- page slack per stream: each stream the backend allocates on ends in a partly used large page or
  segment (20 MiB, kLargeBuffer) and a small one (2 MiB, kSmallBuffer), and no stream reuses another's;
- a fraction of the device bytes the model accounts for: blocks freed but too small, split or on the
  wrong stream for the next request (fragmentation), which expandable segments mostly remove.

Calibrated from the zoo (`python bench/memory_accuracy.py` and `--lora` print every point and check
this table): each fraction is the largest `(needed - requested - slack) / requested` of the backend,
rounded up to the next half percent, where `needed` is the least device memory the replayed allocator
runs in without running out (its empty-the-cache retry included) and `requested` the bytes asked for
at the peak. The largest, because a reserve smaller than the allocator needs is an OOM. Checked against
the allocator's code, not on a GPU.
"""

from __future__ import annotations

from orchestrate.planner.strategy import Strategy

MiB = 2**20
PAGE_SLACK_BYTES = 22 * MiB
"""Per stream: one partly used 20 MiB large page (or 1-10 MiB requests' segment) and a 2 MiB small one."""
STREAMS = {"ddp": 1, "fsdp": 3, "deepspeed": 1}
"""Streams that allocate, as the replay sees them: FSDP2 its default, all-gather copy-in and
reduce-scatter streams (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py); DDP and DeepSpeed
the default one (DeepSpeed's side streams are not seen by a CPU simulation: docs/memory-model.md)."""
RESERVE_FRACTION: dict[str, tuple[float, float]] = {
    # backend: (expandable_segments off, on)
    "ddp": (0.09, 0.04),
    "fsdp": (0.25, 0.025),
    "deepspeed": (0.30, 0.055),
}


def reserve_bytes(backend: str, expandable_segments: bool, nbytes: float) -> float:
    """The reserve on top of `nbytes` the allocator is asked for."""
    fraction = RESERVE_FRACTION[backend][1 if expandable_segments else 0]
    return STREAMS[backend] * PAGE_SLACK_BYTES + fraction * nbytes


def allocator_reserve(accounted: float, strategy: Strategy, expandable_segments: bool) -> float:
    """The reserve of a plan: `accounted` is the device bytes of every term but the CUDA context."""
    return reserve_bytes(strategy.backend, expandable_segments, accounted)
