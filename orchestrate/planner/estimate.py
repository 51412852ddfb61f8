"""What the planner predicts for one strategy: memory per GPU rank and per node, and speed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MemoryEstimate:
    gpu: dict[str, int]
    """Per-rank device bytes at the training peak, by component (weights, gradients, optimizer,
    master_weights, activations, logits, gathered_params, buckets, cuda_context, workspace,
    allocator_reserve, ...). On CPU-only profiles "device" memory is the worker's own CPU RAM."""
    cpu: dict[str, int]
    """Per-node host bytes at the peak, by component (offloaded_optimizer, offloaded_params,
    pinned_buffers, loading_spike, per_process_runtime, ...)."""
    nvme_bytes: int = 0
    """Bytes written to the NVMe offload directory per node."""

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def cpu_total(self) -> int:
        return sum(self.cpu.values())

    def to_dict(self) -> dict:
        return {"gpu": dict(self.gpu), "cpu": dict(self.cpu), "nvme_bytes": self.nvme_bytes,
                "gpu_total": self.gpu_total, "cpu_total": self.cpu_total}

    @classmethod
    def from_dict(cls, data: dict) -> MemoryEstimate:
        return cls(gpu=dict(data["gpu"]), cpu=dict(data["cpu"]), nvme_bytes=int(data.get("nvme_bytes", 0)))


@dataclass(frozen=True)
class SpeedEstimate:
    step_time_s: float
    """Seconds per optimizer step (all micro-batches of the gradient accumulation)."""
    tokens_per_s: float
    """Tokens per second over the whole job."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per step by component (compute, recompute, communication, offload_transfer,
    cpu_optimizer, nvme_io, ...), before overlap."""

    def to_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "breakdown": dict(self.breakdown)}

    @classmethod
    def from_dict(cls, data: dict) -> SpeedEstimate:
        return cls(float(data["step_time_s"]), float(data["tokens_per_s"]), dict(data.get("breakdown", {})))
