"""Replay what a simulation allocated and freed through the caching-allocator model, so a fake-tensor
run reports the allocated and reserved peaks a GPU would (`torch.cuda.max_memory_allocated` /
`max_memory_reserved`), with expandable segments off and on.

The sequence is the counter's storage lifetimes (`counter.Life`) on its one event clock: a birth is a
`malloc` of the storage's bytes on the stream that was current, a death a `free`; FSDP2's
`UntypedStorage.resize_` to 0 and back is a free and a new malloc, as on CUDA.

What the replay assumes:
- Training only. The simulation builds the model its own way (full size on the fake device, then
  wrapped), not as a GPU worker loads it, so setup is not replayed: the storages live when training
  starts are allocated first, in the order they were born, into an empty cache.
- Streams as FSDP2 picks them. On CPU `torch.cpu.stream(...)` records the stream FSDP2 enters, so
  its all-gather copy-in buffers and reduce-scatter outputs land in pools of their own, as on
  CUDA. DDP's reducer and DeepSpeed's side streams are invisible on CPU (everything counts as the
  default stream), and so are `record_stream` deferrals (ProcessGroupNCCL may hold a freed
  collective buffer until the collective ends): a free here is immediate.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrate.simulate.allocator import CachingAllocator, OutOfMemory
from orchestrate.simulate.allocator_settings import K_ROUND_LARGE, AllocatorSettings

SETTINGS = {"segments": AllocatorSettings(), "expandable": AllocatorSettings(expandable_segments=True)}
"""The two settings every simulation replays: torch's default, and `expandable_segments:True`
(what orchestrate sets on GPU launches)."""


@dataclass(frozen=True)
class Trace:
    """Allocation sizes and streams by index, and the order of events: `i + 1` allocates storage i,
    `-(i + 1)` frees it. The first `initial` events set up the state training starts from."""

    sizes: list[int]
    streams: list[int]
    events: list[int]
    initial: int


@dataclass(frozen=True)
class ReplayPeaks:
    allocated: int
    """Peak of allocated blocks (rounded sizes, unsplit remainders included)."""
    reserved: int
    """Peak of reserved segments (mapped pages with expandable segments)."""
    requested: int
    """Peak of the bytes asked for (the simulation's own live-storage peak, over the same events)."""
    retries: int
    """Times the cache had to be emptied to serve a request (0 with unlimited capacity)."""



def trace_from_lives(lives, start: int) -> Trace:
    """The allocation sequence of the storages alive at event time `start` and born after it."""
    keep = [lf for lf in lives if lf.nbytes and (lf.death is None or lf.death > start)]
    initial = sorted((lf for lf in keep if lf.birth <= start), key=lambda lf: lf.birth)
    later = [lf for lf in keep if lf.birth > start]
    order = initial + later
    index = {id(lf): i for i, lf in enumerate(order)}
    timed = [(lf.birth, index[id(lf)] + 1) for lf in later]
    timed += [(lf.death, -(index[id(lf)] + 1)) for lf in keep if lf.death is not None]
    events = [i + 1 for i in range(len(initial))] + [e for _, e in sorted(timed)]
    return Trace(sizes=[lf.nbytes for lf in order], streams=[lf.stream for lf in order], events=events,
                 initial=len(initial))


def replay(trace: Trace, settings: AllocatorSettings, capacity: int | None = None) -> ReplayPeaks:
    """The peaks over the events after the initial state; OutOfMemory if `capacity` is too small."""
    alloc = CachingAllocator(settings, capacity)
    blocks: list = [None] * len(trace.sizes)
    sizes, streams, events = trace.sizes, trace.streams, trace.events
    for n, event in enumerate(events):
        if n == trace.initial:
            alloc.peak_allocated, alloc.peak_reserved, alloc.peak_requested = (
                alloc.allocated, alloc.reserved, alloc.requested)
        if event > 0:
            blocks[event - 1] = alloc.malloc(sizes[event - 1], streams[event - 1])
        else:
            alloc.free(blocks[-event - 1])
            blocks[-event - 1] = None
    return ReplayPeaks(alloc.peak_allocated, alloc.peak_reserved, alloc.peak_requested, alloc.retries)


def smallest_capacity(trace: Trace, settings: AllocatorSettings) -> int:
    """The least device memory the replay runs in without running out: below the unlimited run's
    reserved peak where emptying the cache on a failed request (the allocator's retry) is enough.
    Bisected over multiples of 2 MiB, the granularity of every segment and page."""
    step = K_ROUND_LARGE
    unlimited = replay(trace, settings)
    lo, hi = -(-unlimited.allocated // step) - 1, -(-unlimited.reserved // step)  # lo * step < allocated fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            replay(trace, settings, capacity=mid * step)
            hi = mid
        except OutOfMemory:
            lo = mid
    return hi * step


def allocator_peaks(lives, start: int) -> dict[str, dict[str, int]]:
    """For both settings (`SETTINGS`) and a simulation's lifetimes from event time `start` on: the
    peaks on an unlimited device (allocated, reserved, requested) and the device memory the
    allocator needs to run without running out (needed, `smallest_capacity`)."""
    trace = trace_from_lives(lives, start)
    out = {}
    for name, settings in SETTINGS.items():
        peaks = replay(trace, settings)
        out[name] = {"allocated": peaks.allocated, "reserved": peaks.reserved, "requested": peaks.requested,
                     "needed": smallest_capacity(trace, settings)}
    return out
