"""The memory verdict: what the plan predicted per rank (and per node) next to what the run measured.

Pure: it reads the metrics.jsonl records (`orchestrate/worker/metrics.py` says what each field
measures) and the plan; printing is the caller's. Measured values are peaks over the whole run and
over ranks (the records carry the max over ranks), so "per rank" means "the largest rank".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchestrate.hardware.units import format_bytes

if TYPE_CHECKING:
    from orchestrate.planner.plan import RunPlan

# The CPU-only counterpart of a GPU's allocator peak is the process RSS, which also holds the
# interpreter, torch's and the other libraries' code and data: several hundred MiB before any tensor.
RSS_NOTE = ("CPU run: the measured per-rank peak is the worker's RSS, which includes the Python "
            "interpreter and shared libraries (torch alone maps several hundred MiB), not only the "
            "tensors the plan predicts; read the ratio as an upper bound. torch keeps no allocator "
            "statistics for CPU tensors, so the tensor peak itself is not measured here "
            "(`orchestrate plan --simulate` counts it).")

# The plan's allocator reserve covers what the allocator needs to run (planner/allocator_reserve.py),
# not the cache it keeps while there is room.
RESERVED_NOTE = ("GPU run: the plan predicts the memory the CUDA caching allocator needs, which frees its cache "
                 "and retries when a request fails (docs/memory-model.md); max_memory_reserved also counts the "
                 "segments it keeps for reuse while the device has room to spare, so a reserved peak above the "
                 "prediction with the allocated peak below it is that cache, not an under-prediction.")


@dataclass(frozen=True)
class MemoryCheck:
    what: str
    """e.g. "GPU allocated peak per rank"."""
    predicted: int
    measured: int

    @property
    def ratio(self) -> float:
        """measured / predicted (> 1: the plan under-predicted)."""
        return self.measured / self.predicted if self.predicted else float("inf")

    @property
    def over(self) -> bool:
        return self.measured > self.predicted


@dataclass(frozen=True)
class MemoryVerdict:
    checks: list[MemoryCheck]
    notes: list[str] = field(default_factory=list)

    @property
    def warnings(self) -> list[str]:
        return [f"WARNING: {c.what}: measured {format_bytes(c.measured)} exceeds the predicted "
                f"{format_bytes(c.predicted)} ({c.ratio:.2f}x)" for c in self.checks if c.over]

    def lines(self) -> list[str]:
        out = ["memory verdict (measured peak over the run and ranks vs the plan's prediction):"]
        out += [f"  {c.what}: predicted {format_bytes(c.predicted)}, measured {format_bytes(c.measured)}, "
                f"measured/predicted {c.ratio:.2f}" for c in self.checks]
        if not self.checks:
            out.append("  nothing to compare: the records carry no memory measurements")
        out += self.warnings
        out += [f"  note: {n}" for n in self.notes]
        return out

    def text(self) -> str:
        return "\n".join(self.lines())


def _peak(records: list[dict[str, Any]], key: str) -> int | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return int(max(values)) if values else None


def memory_verdict(records: list[dict[str, Any]], plan: RunPlan) -> MemoryVerdict:
    """Compare the run's measured peaks with `plan.chosen`'s predictions."""
    gpu_pred = plan.chosen.memory.gpu_total
    cpu_pred = plan.chosen.memory.cpu_total
    checks: list[MemoryCheck] = []
    notes: list[str] = []
    alloc = _peak(records, "gpu_max_allocated_bytes")
    reserved = _peak(records, "gpu_max_reserved_bytes")
    if alloc is not None:
        checks.append(MemoryCheck("GPU allocated peak per rank (torch.cuda.max_memory_allocated)", gpu_pred, alloc))
    if reserved is not None:
        # The prediction includes the allocator reserve and CUDA context (planner/memory.py), so the
        # reserved peak is the closer counterpart; allocated is shown to see the allocator's share.
        checks.append(MemoryCheck("GPU reserved peak per rank (torch.cuda.max_memory_reserved)", gpu_pred, reserved))
        notes.append(RESERVED_NOTE)
    if alloc is None and reserved is None:
        rss = _peak(records, "rss_peak_bytes_max_rank")
        if rss is not None:
            checks.append(MemoryCheck("CPU worker RSS peak per rank (ru_maxrss)", gpu_pred, rss))
            notes.append(RSS_NOTE)
    node = _peak(records, "node_rss_peak_bytes")
    if node is not None:
        checks.append(MemoryCheck("host RSS of node 0 (sum of its ranks' peaks)", cpu_pred, node))
        notes.append("the node figure sums each rank's own peak, an upper bound: the ranks need not peak together")
    return MemoryVerdict(checks, notes)
