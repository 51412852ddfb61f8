"""What the planner predicts for one strategy: memory per GPU rank and per node, and speed.
Pydantic dataclasses: plan.json holds them as they serialise (totals included)."""

from __future__ import annotations

from dataclasses import field

from pydantic import computed_field
from pydantic.dataclasses import dataclass

CORRECTION_KEY = "measured_correction"
"""What the machine's measured corrections add (hardware/profile.py MemoryCorrection): the
analytical total times (ratio - 1); only in the breakdown of a plan that has one."""
OUTSIDE_ALLOCATOR = ("cuda_context", "nccl_buffers")
"""Device memory the CUDA caching allocator never sees: torch.cuda's peaks do not count it."""


@dataclass(frozen=True)
class MemoryEstimate:
    gpu: dict[str, int]
    """Per-rank device bytes at the training peak, by component (planner/memory.py `breakdown_keys`:
    weights, gradients, optimizer_states, master_weights, activations, logits, gathered_params,
    comm_buckets, nccl_buffers, cuda_context, workspace, allocator_reserve, then the plan's methods' own
    terms). On CPU-only profiles "device" memory is the worker's own CPU RAM."""
    cpu: dict[str, int]
    """Per-node host bytes at the peak, by component (offloaded_optimizer, offloaded_params,
    pinned_buffers, loading_spike, process_runtime, ..., then the methods' own)."""
    nvme_bytes: int = 0
    """Bytes written to the NVMe offload directory per node."""

    @computed_field
    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @computed_field
    @property
    def cpu_total(self) -> int:
        return sum(self.cpu.values())

    @property
    def gpu_outside_allocator(self) -> int:
        """The CUDA context and NCCL's buffers (OUTSIDE_ALLOCATOR)."""
        return sum(self.gpu.get(key, 0) for key in OUTSIDE_ALLOCATOR)

    @property
    def gpu_allocator(self) -> int:
        """What the caching allocator holds at the peak on a card without room to spare, the tensors and
        the allocator's reserve: torch.cuda.max_memory_reserved's counterpart (analytical, no correction)."""
        return self.gpu_total - self.gpu_outside_allocator - self.gpu.get(CORRECTION_KEY, 0)

    @property
    def gpu_tensors(self) -> int:
        """The bytes tensors ask the allocator for at the peak: torch.cuda.max_memory_allocated's
        counterpart (analytical, no correction)."""
        return self.gpu_allocator - self.gpu.get("allocator_reserve", 0)


@dataclass(frozen=True)
class SpeedEstimate:
    step_time_s: float
    """Seconds per optimizer step (all micro-batches of the gradient accumulation)."""
    tokens_per_s: float
    """Tokens per second over the whole job."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per step by component (compute, recompute, communication, offload_transfer,
    cpu_optimizer, nvme_io, ...), before overlap."""
