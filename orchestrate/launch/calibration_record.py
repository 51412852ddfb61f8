"""What a finished run or an out-of-memory error adds to this machine's calibration file
(hardware/calibration.py): measured / the analytical per-rank prediction, for the plan's family.

Like with like, against the prediction without the measured corrections it may already carry:
- a finished run: the plan with the measured tensors in place of the predicted ones, i.e. the
  allocated peak (torch.cuda.max_memory_allocated, max over ranks) plus the allocator reserve the
  planner adds to that many bytes plus what lies outside the allocator as planned (context, NCCL).
  Not the reserved peak: on a card with room the allocator keeps freed segments cached instead of
  giving them back, so max_memory_reserved says what it held, not what it needed; the allocated peak
  tracks each run's need (why: docs/measurements.md#launchcalibration_recordpy). What the allocator needs
  beyond the planned reserve on a full card ends in an out-of-memory error, recorded below;
- an out-of-memory error: its measured need (a lower bound, worker/oom.py).
CPU runs have no allocator peak and record nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrate.hardware.calibration import record
from orchestrate.planner.allocator_reserve import allocator_reserve, state_bytes
from orchestrate.planner.estimate import CORRECTION_KEY
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import RunDir, read_records


def analytical_bytes(plan: RunPlan) -> int:
    memory = plan.chosen.memory
    return memory.gpu_total - memory.gpu.get(CORRECTION_KEY, 0)


def measured_need(allocated: int, plan: RunPlan) -> float:
    """The plan's device bytes per rank with `allocated` (a measured allocated peak) as its tensors."""
    memory = plan.chosen.memory
    nccl = memory.gpu.get("nccl_buffers", 0)
    # memory.py reserves on every term but the context, NCCL's buffers among its states
    reserve = allocator_reserve(allocated + nccl, state_bytes(memory.gpu), plan.strategy,
                                plan.hardware.expandable_segments)
    return allocated + reserve + memory.gpu_outside_allocator


def verdict_ratio(records: list[dict[str, Any]], plan: RunPlan) -> float | None:
    """measured / analytical from a run's metrics records; None without a GPU allocated peak."""
    allocated = [r["gpu_max_allocated_bytes"] for r in records if r.get("gpu_max_allocated_bytes") is not None]
    if not allocated:
        return None
    return measured_need(max(allocated), plan) / max(1, analytical_bytes(plan))


def record_verdict(plan: RunPlan, run_dir: Path, path: Path | None = None) -> str | None:
    """After a finished run: its verdict into the calibration file; the line to print, or None."""
    metrics = RunDir(Path(run_dir)).metrics
    ratio = verdict_ratio(read_records(metrics), plan) if metrics.is_file() else None
    if ratio is None:
        return None
    return record(plan.hardware, plan.strategy.family, ratio, f"memory verdict of {run_dir}", path)


def record_oom_ratio(plan: RunPlan, worst: dict[str, Any], path: Path | None = None) -> str | None:
    """After an out-of-memory error on a GPU: its measured need into the calibration file."""
    if worst.get("device") != "cuda":
        return None
    ratio = worst["needed_at_least_bytes"] / max(1, analytical_bytes(plan))
    return record(plan.hardware, plan.strategy.family, ratio, f"out-of-memory at step {worst['step']}", path)
