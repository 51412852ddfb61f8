"""The CUDA caching allocator's reserve: device memory the allocator needs beyond the bytes tensors
ask for (segments cached for other sizes and other streams, large-pool remainders of 1 MiB or less
left unsplit, pages mapped 20 MiB at a time), as a fraction of the device bytes the model accounts for.

Calibrated, per backend and `expandable_segments` setting (`HardwareProfile.expandable_segments`),
from the simulation zoo replayed through the caching-allocator model (orchestrate/simulate/replay.py;
`python bench/memory_accuracy.py` and `--lora` print every point and this table's check): each
fraction is the zoo's largest `needed / requested - 1`, rounded up to the next percent, where
`needed` is the least device memory the replayed allocator runs in without an out-of-memory error
(its empty-the-cache retry included) and `requested` the bytes asked for at the peak. Predicting the
largest keeps the plan on the safe side: a smaller reserve than the allocator needs is an OOM.
Checked against the allocator's code only, not yet on a GPU (docs/memory-model.md).
"""

from __future__ import annotations

from orchestrate.planner.strategy import Strategy

RESERVE_FRACTION: dict[str, tuple[float, float]] = {
    # backend: (expandable_segments off, on)
    "ddp": (0.07, 0.04),
    "fsdp": (0.13, 0.03),
    "deepspeed": (0.13, 0.03),
}


def reserve_fraction(backend: str, expandable_segments: bool) -> float:
    return RESERVE_FRACTION[backend][1 if expandable_segments else 0]


def allocator_reserve(accounted: float, strategy: Strategy, expandable_segments: bool) -> float:
    """The reserve on top of `accounted`, the device bytes of every term but the CUDA context."""
    return reserve_fraction(strategy.backend, expandable_segments) * accounted
