"""An out-of-memory error in a training step, written down for the launcher (docs/fault-tolerance.md).

The step loop turns a `torch.OutOfMemoryError` into `StepOutOfMemory` (the step and the phase the
engine was in: forward, backward, optimizer); the worker's recipe writes this rank's record,
RUN_DIR/oom/rank-<N>.json, and exits EX_OUT_OF_MEMORY without another collective (a peer may be
gone or stuck). The launcher reads it and re-plans (launch/oom_replan.py).

What the record calls the peak: at an OOM the caching allocator could not hand out the request on
top of what it had reserved (it frees its cache and retries before raising), so the rank needed at
least max(peak reserved, reserved now + the failed request); the CUDA context and NCCL's buffers lie
outside the allocator and are taken as planned (the prediction counts them). torch keeps no allocator
statistics for CPU tensors, so on a CPU run (where only an injected error comes here) the failed
request alone stands for it.
"""

from __future__ import annotations

import re
import sys
import time
from typing import TYPE_CHECKING, Any

from orchestrate.run.layout import write_oom_record

if TYPE_CHECKING:
    from pathlib import Path

    from orchestrate.backends.rank import Rank
    from orchestrate.planner.plan import RunPlan

# PyTorch's message (c10/cuda/CUDACachingAllocator.cpp, format_size): "Tried to allocate 2.00 GiB".
_REQUEST = re.compile(r"Tried to allocate ([0-9.]+) (bytes|KiB|MiB|GiB|TiB)")
_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


class StepOutOfMemory(Exception):
    """A training step ran out of device memory: where, and the original error as __cause__."""

    def __init__(self, step: int, phase: str) -> None:
        super().__init__(f"out of memory at step {step} ({phase})")
        self.step = step
        self.phase = phase


def requested_bytes(message: str) -> int:
    """The failed allocation's size from PyTorch's message; 0 when it does not say."""
    match = _REQUEST.search(message)
    return int(float(match.group(1)) * _UNITS[match.group(2)]) if match else 0


def oom_record(plan: RunPlan, rank: Rank, step: int, phase: str, error: BaseException) -> dict[str, Any]:
    """This rank's record (module docstring: what "needed at least" means)."""
    import torch

    message = str(error)
    requested = requested_bytes(message)
    device = rank.device
    allocated = reserved_peak = reserved_now = 0
    if device.type == "cuda":
        allocated = torch.cuda.max_memory_allocated(device)
        reserved_peak = torch.cuda.max_memory_reserved(device)
        reserved_now = torch.cuda.memory_reserved(device)
    outside = plan.chosen.memory.gpu_outside_allocator
    return {"rank": rank.rank, "node": rank.node, "step": step, "phase": phase, "device": device.type,
            "max_allocated_bytes": allocated, "max_reserved_bytes": reserved_peak,
            "reserved_bytes": reserved_now, "requested_bytes": requested,
            "needed_at_least_bytes": max(reserved_peak, reserved_now + requested) + outside,
            "predicted_bytes": plan.chosen.memory.gpu_total, "strategy": plan.chosen.name,
            "message": message[:2000], "time": time.time()}


def record_oom(plan: RunPlan, rank: Rank, run_dir: Path, step: int, phase: str, error: BaseException) -> None:
    """Write this rank's record and say so on stderr (the launcher relays it)."""
    record = oom_record(plan, rank, step, phase, error)
    path = write_oom_record(run_dir, rank.rank, record)
    print(f"rank {rank.rank}: out of memory at step {step} ({phase}); recorded in {path}", file=sys.stderr,
          flush=True)


