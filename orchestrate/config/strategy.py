"""The `strategy:` section: how to distribute the training; every field may stay "auto"."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from orchestrate.config.section import Auto, Section


class StrategySection(Section):
    wrap: list[str] | None = None
    """`model.module` only: the block classes FSDP2 shards one by one and activation checkpointing
    wraps, e.g. [ResidualBlock]; null detects them (the most repeated submodule class holding parameters)."""

    backend: Literal["auto", "deepspeed", "fsdp", "ddp"] = "auto"
    """Distributed backend; "auto" lets the planner choose."""

    zero_stage: int | Auto = "auto"
    """ZeRO stage 0-3 (for fsdp: 3 = full shard, 2 = shard grads and optimizer only)."""

    offload: Literal["auto", "none", "cpu", "nvme"] = "auto"
    """Where optimizer states live when not on the GPU."""

    offload_params: bool | Auto = "auto"
    """Also offload parameters (ZeRO-3 / FSDP full shard only) to the `offload` target."""

    nvme_path: str | None = None
    """Directory on a fast NVMe disk for NVMe offload (needed when offload is "nvme")."""

    gpu_memory_headroom: float = Field(default=0.90, gt=0.1, le=1.0)
    """Fraction of each GPU's memory the plan may use; the rest absorbs allocator fragmentation
    and what the model cannot see."""

    cpu_memory_headroom: float = Field(default=0.85, gt=0.1, le=1.0)
    """Fraction of each node's CPU RAM the plan may use (the OS, page cache and data loaders need the rest)."""

    @field_validator("zero_stage")
    @classmethod
    def _stage_range(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 0 <= v <= 3:
            raise ValueError("zero_stage must be 0, 1, 2, 3 or auto")
        return v
