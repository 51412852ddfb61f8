"""The CUDA caching allocator's reserve: device memory the allocator needs beyond the bytes tensors ask
for, from a model of c10/cuda/CUDACachingAllocator.cpp replayed over the simulation zoo
(orchestrate/simulate/allocator.py, replay.py; docs/memory-model.md).

Per backend and `expandable_segments` setting (`HardwareProfile.expandable_segments`), a constant plus
a fraction of the device bytes the model accounts for:
- the constant: each stream the backend allocates on ends in partly used pages or segments (20 MiB
  large, kLargeBuffer; 2 MiB small, kSmallBuffer) that no other stream may use; with expandable
  segments this is nearly all of the overhead (12-379 MiB over requests of 0.35-17.8 GiB);
- the fraction: blocks freed but too small, split, or on the wrong stream for the next request
  (fragmentation), which expandable segments mostly remove.

Fitted by `python bench/allocator_reserve_fit.py` over the full and LoRA zoos and 8- and 16-block models, all
replayed: the pair covering every point's `needed - requested` (needed: the least device memory the
replayed allocator runs in without running out, its empty-the-cache retry included) with the smallest
reserve for a 6 GiB request, the constant at least the page slack of the backend's streams, the
fraction at least 1 %.
Covering every point, because a reserve smaller than the allocator needs is an OOM. Checked against
the allocator's code, not on a GPU.
"""

from __future__ import annotations

from orchestrate.backends.registry import priced_as
from orchestrate.planner.strategy import Strategy

MiB = 2**20
RESERVE: dict[str, dict[bool, tuple[int, float]]] = {
    # backend: {expandable_segments: (constant MiB, fraction)}
    "ddp": {False: (22, 0.24), True: (96, 0.02)},
    "fsdp": {False: (496, 0.165), True: (94, 0.01)},
    "deepspeed": {False: (22, 0.35), True: (110, 0.01)},
}


def reserve_bytes(backend: str, expandable_segments: bool, nbytes: float) -> float:
    """The reserve on top of `nbytes` the allocator is asked for."""
    constant, fraction = RESERVE[backend][expandable_segments]
    return constant * MiB + fraction * nbytes


def allocator_reserve(accounted: float, strategy: Strategy, expandable_segments: bool) -> float:
    """The reserve of a plan: `accounted` is the device bytes of every term but the CUDA context; a
    registered backend takes the reserve of the built-in one it is priced as."""
    return reserve_bytes(priced_as(strategy.backend), expandable_segments, accounted)
