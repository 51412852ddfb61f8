"""The memory and MFU a progress line shows, from one metrics record (worker and launcher alike)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orchestrate.hardware.units import format_bytes
from orchestrate.report.mfu import utilisation

if TYPE_CHECKING:
    from orchestrate.planner.plan import RunPlan


def memory_and_mfu(record: dict[str, Any], plan: RunPlan) -> str:
    """"mem 5.12 GiB/6.20 GiB  MFU 38.5%": the measured peak per rank against the plan's prediction of
    it (GPU allocated against the planned tensors, as the memory verdict; else the CPU tensor peak
    against the per-rank prediction), and MFU where the peak FLOP/s are known."""
    gpu = record.get("gpu_max_allocated_bytes")
    measured = gpu if gpu is not None else record.get("cpu_tensor_peak_bytes")
    parts = []
    if measured is not None:
        predicted = plan.chosen.memory.gpu_tensors if gpu is not None else record.get("predicted_gpu_bytes_per_rank")
        parts.append(f"mem {format_bytes(measured)}" + (f"/{format_bytes(predicted)}" if predicted else ""))
    mfu = utilisation(float(record["tokens_per_s"]), plan).get("mfu") if record.get("tokens_per_s") else None
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    return "  ".join(parts)
