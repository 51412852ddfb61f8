"""The CUDA caching allocator's reserve: device memory the allocator needs beyond the bytes tensors ask
for, from a model of c10/cuda/CUDACachingAllocator.cpp replayed over the simulation zoo
(orchestrate/simulate/allocator.py, replay.py; docs/memory-model.md).

Per backend and `expandable_segments` setting (`HardwareProfile.expandable_segments`), a constant plus
a fraction of the states a plan allocates once (STATE_TERMS) and another of the rest, its transient
bytes (allocated and freed every step):
- the constant: each stream the backend allocates on ends in partly used pages or segments (20 MiB
  large, kLargeBuffer; 2 MiB small, kSmallBuffer) that no other stream may use; with expandable
  segments this is nearly all of the overhead;
- the fractions: blocks freed but too small, split, or on the wrong stream for the next request
  (fragmentation), which expandable segments mostly remove. Without them it follows the transient
  bytes and hardly the states allocated once: one fraction of everything would charge a state-heavy
  plan (QLoRA of a large model, a short sequence) for fragmentation its states do not cause.

Fitted over the replayed simulation zoo (docs/measurements.md#plannerallocator_reservepy): the triple covering every point's `needed - requested` (needed: the least device memory the
replayed allocator runs in without running out, its empty-the-cache retry included; states: the
analytical model's for that point, transient: the rest of the request) with the smallest reserve for a
6 GiB request of which 2 GiB are transient, the constant at least the page slack of the backend's
streams, each fraction at least 1 %.
Covering every point, because a reserve smaller than the allocator needs is an OOM. Checked against
the allocator's code, not on a GPU.
"""

from __future__ import annotations

from orchestrate.backends.registry import priced_as
from orchestrate.planner.strategy import Strategy

MiB = 2**20
RESERVE: dict[str, dict[bool, tuple[int, float, float]]] = {
    # backend: {expandable_segments: (constant MiB, fraction of states, fraction of transient bytes)}
    "ddp": {False: (282, 0.01, 0.31), True: (96, 0.02, 0.02)},
    "fsdp": {False: (284, 0.01, 0.265), True: (94, 0.01, 0.01)},
    "deepspeed": {False: (994, 0.065, 0.27), True: (110, 0.01, 0.01)},
}
STATE_TERMS = ("weights", "gradients", "optimizer_states", "master_weights", "comm_buckets", "nccl_buffers",
               "workspace")
"""Memory terms (planner/memory.py) the allocator serves once and keeps: the model states, DDP's
buckets, cuBLAS' workspace (and NCCL's buffers, which lie outside it, counted as states: they never
fragment). Every other term is transient: activations, logits, parameters gathered
(FSDP, ZeRO-3) or cast (DDP's autocast copies) for one block, a method's auxiliary outputs; a frozen
teacher's or reference's weights are counted with them (the larger fraction: predict high)."""


def state_bytes(gpu: dict[str, float]) -> float:
    return sum(gpu.get(term, 0.0) for term in STATE_TERMS)


def reserve_bytes(backend: str, expandable_segments: bool, nbytes: float, states: float) -> float:
    """The reserve on top of `nbytes` the allocator is asked for, `states` of them kept (STATE_TERMS)."""
    constant, of_states, of_transient = RESERVE[backend][expandable_segments]
    states = min(states, nbytes)
    return constant * MiB + of_states * states + of_transient * (nbytes - states)


def allocator_reserve(accounted: float, states: float, strategy: Strategy, expandable_segments: bool) -> float:
    """The reserve of a plan: `accounted` is the device bytes of every term but the CUDA context,
    `states` those of its STATE_TERMS; a registered backend takes the reserve of the built-in one it is
    priced as."""
    return reserve_bytes(priced_as(strategy.backend), expandable_segments, accounted, states)
