"""What a finished run or an out-of-memory error adds to this machine's calibration file
(hardware/calibration.py): measured / the analytical per-rank prediction, for the plan's family.

Like with like: the memory verdict's GPU reserved peak (torch.cuda.max_memory_reserved, max over
ranks) plus the predicted CUDA context, which lies outside the allocator, against the prediction
without the measured corrections it may already carry; an OOM's measured need (a lower bound,
worker/oom.py) against the same. CPU runs have no allocator peak and record nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrate.hardware.calibration import record
from orchestrate.planner.memory import CORRECTION_KEY
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import RunDir, read_records


def analytical_bytes(plan: RunPlan) -> int:
    memory = plan.chosen.memory
    return memory.gpu_total - memory.gpu.get(CORRECTION_KEY, 0)


def verdict_ratio(records: list[dict[str, Any]], plan: RunPlan) -> float | None:
    """measured / analytical from a run's metrics records; None without a GPU reserved peak."""
    reserved = [r["gpu_max_reserved_bytes"] for r in records if r.get("gpu_max_reserved_bytes") is not None]
    if not reserved:
        return None
    return (max(reserved) + plan.chosen.memory.gpu.get("cuda_context", 0)) / max(1, analytical_bytes(plan))


def record_verdict(plan: RunPlan, run_dir: Path, path: Path | None = None) -> str | None:
    """After a finished run: its verdict into the calibration file; the line to print, or None."""
    metrics = RunDir(Path(run_dir)).metrics
    ratio = verdict_ratio(read_records(metrics), plan) if metrics.is_file() else None
    if ratio is None:
        return None
    return record(plan.hardware, plan.chosen.strategy.family, ratio, f"memory verdict of {run_dir}", path)


def record_oom_ratio(plan: RunPlan, worst: dict[str, Any], path: Path | None = None) -> str | None:
    """After an out-of-memory error on a GPU: its measured need into the calibration file."""
    if worst.get("device") != "cuda":
        return None
    ratio = worst["needed_at_least_bytes"] / max(1, analytical_bytes(plan))
    return record(plan.hardware, plan.chosen.strategy.family, ratio, f"out-of-memory at step {worst['step']}", path)
