"""The memory verdict: what the plan predicted per rank (and per node) next to what the run measured.

Pure: it reads the metrics.jsonl records (`orchestrate/worker/metrics.py` says what each field
measures) and the plan; printing is the caller's. Measured values are peaks over the run (a CPU
run's tensor peak: over start-up and the first steps) and over ranks (the records carry the max over
ranks), so "per rank" means "the largest rank". On a CPU run the plan's "device" is the worker's own
RAM: its per-rank prediction counts tensors, and so does the CPU tensor peak; the process RSS is
shown beside it, not compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchestrate.hardware.units import format_bytes
from orchestrate.planner.estimate import CORRECTION_KEY

if TYPE_CHECKING:
    from orchestrate.planner.plan import RunPlan

TOLERANCE = 0.05
"""How far a measured peak may exceed its prediction before the verdict warns. The analytical model
is meant to predict high, and against the simulation (which matches real CPU runs) it under-predicts
by less than this (why: docs/measurements.md#reportmemory_verdictpy)."""

RSS_INFO = ("the RSS also holds the Python interpreter and every library (torch alone maps several hundred "
            "MiB), so it is shown, not compared; the tensor peak above is the plan's counterpart")
NO_TENSOR_PEAK = ("CPU run without a tensor peak in its records (written before orchestrate measured it): "
                  "nothing to compare the per-rank prediction with; `orchestrate plan --simulate` counts the tensors")

# The plan's allocator reserve covers what the allocator needs to run (planner/allocator_reserve.py),
# not the cache it keeps while there is room.
RESERVED_NOTE = ("GPU run: the plan predicts the memory the CUDA caching allocator needs, which frees its cache "
                 "and retries when a request fails (docs/memory-model.md); max_memory_reserved also counts the "
                 "segments it keeps for reuse while the device has room to spare, so a reserved peak above the "
                 "prediction with the allocated peak within it is that cache, not an under-prediction (the "
                 "calibration file takes the allocated peak for this reason: launch/calibration_record.py).")


@dataclass(frozen=True)
class MemoryCheck:
    what: str
    """e.g. "GPU allocated peak per rank"."""
    predicted: int
    measured: int
    cache: bool = False
    """A reserved peak whose run's allocated peak is within its prediction: what exceeds the plan is the
    allocator's cache on a card with room (RESERVED_NOTE), said, not warned about."""

    @property
    def ratio(self) -> float:
        """measured / predicted (> 1: the plan under-predicted)."""
        return self.measured / self.predicted if self.predicted else float("inf")

    @property
    def over(self) -> bool:
        """Measured beyond the prediction's tolerance: an under-prediction the plan's headroom must absorb."""
        return self.measured > self.predicted * (1 + TOLERANCE)

    @property
    def verdict(self) -> str:
        return "within" if not self.over else "the allocator's cache" if self.cache else "over"


@dataclass(frozen=True)
class MemoryVerdict:
    checks: list[MemoryCheck]
    notes: list[str] = field(default_factory=list)
    shown: list[str] = field(default_factory=list)
    """Measurements shown for information, not compared with a prediction."""

    @property
    def warnings(self) -> list[str]:
        return [f"WARNING: {c.what}: measured {format_bytes(c.measured)} exceeds the predicted "
                f"{format_bytes(c.predicted)} by more than {TOLERANCE:.0%} ({c.ratio:.2f}x)"
                for c in self.checks if c.verdict == "over"]

    def lines(self) -> list[str]:
        out = [f"memory verdict (measured peak of the largest rank vs the plan's prediction; a warning past "
               f"+{TOLERANCE:.0%}):"]
        out += [f"  {c.what}: predicted {format_bytes(c.predicted)}, measured {format_bytes(c.measured)} "
                f"({c.ratio:.2f}x{'' if c.verdict == 'over' else ', ' + c.verdict})" for c in self.checks]
        if not self.checks:
            out.append("  nothing to compare: the records carry no memory measurements")
        out += [f"  shown: {line}" for line in self.shown]
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
    memory = plan.chosen.memory
    gpu_pred, cpu_pred = memory.gpu_total, memory.cpu_total
    checks: list[MemoryCheck] = []
    notes: list[str] = []
    alloc = _peak(records, "gpu_max_allocated_bytes")
    reserved = _peak(records, "gpu_max_reserved_bytes")
    # Like with like: torch's peaks count neither the CUDA context nor NCCL's buffers (outside the
    # allocator), the allocated peak not the allocator's reserve either.
    allocated = MemoryCheck("GPU allocated peak per rank (torch.cuda.max_memory_allocated) vs the planned tensors",
                            memory.gpu_tensors, alloc or 0)
    if alloc is not None:
        checks.append(allocated)
    if reserved is not None:
        checks.append(MemoryCheck("GPU reserved peak per rank (torch.cuda.max_memory_reserved) vs the planned "
                                  "tensors and allocator reserve", memory.gpu_allocator, reserved,
                                  cache=alloc is not None and not allocated.over))
        notes.append(RESERVED_NOTE)
    shown: list[str] = []
    if alloc is not None or reserved is not None:
        correction = memory.gpu.get(CORRECTION_KEY, 0)
        shown.append(f"planned device memory per rank {format_bytes(gpu_pred)}: tensors and reserve plus "
                     f"{format_bytes(memory.gpu_outside_allocator)} outside the allocator (CUDA context, NCCL's "
                     "buffers)" + (f" and a measured correction of {format_bytes(correction)}" if correction else ""))
    else:  # a CPU run: the plan's "device" is the worker's own RAM
        tensors = _peak(records, "cpu_tensor_peak_bytes")
        if tensors is not None:
            # counted over start-up and the first steps (orchestrate/worker/tensor_peak.py)
            checks.append(MemoryCheck("CPU tensor peak per rank (live tensor storages)", gpu_pred, tensors))
        else:
            notes.append(NO_TENSOR_PEAK)
        rss = _peak(records, "rss_peak_bytes_max_rank")
        if rss is not None:
            shown.append(f"CPU worker RSS peak per rank (ru_maxrss) {format_bytes(rss)}: {RSS_INFO}")
    node = _peak(records, "node_rss_peak_bytes")
    if node is not None:
        checks.append(MemoryCheck("host RSS of node 0 (sum of its ranks' peaks)", cpu_pred, node))
        notes.append("the node figure sums each rank's own peak, an upper bound: the ranks need not peak together")
    return MemoryVerdict(checks, notes, shown)
