"""An out-of-memory error in a worker, written down for the launcher (docs/fault-tolerance.md).

The step loop turns a `torch.OutOfMemoryError` (device memory) or the host's (`host_out_of_memory`:
torch's CPU allocator's RuntimeError, Python's MemoryError) into `StepOutOfMemory` (the step and the
phase the engine was in: forward, backward, optimizer); the worker's recipe writes this rank's
record, RUN_DIR/oom/rank-<N>.json, and exits EX_OUT_OF_MEMORY without another collective (a peer may
be gone or stuck); a host out-of-memory error outside the steps (building the data or the model,
saving) is recorded the same way, without a step. The launcher reads the records: it re-plans a
device shortfall (launch/oom_replan.py) and words a host one (host memory, the rank, what would
help), which no re-plan of the device memory model fixes.

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
# PyTorch's CPU allocator (c10/core/impl/alloc_cpu.cpp, alloc_cpu): "DefaultCPUAllocator: can't allocate
# memory: you tried to allocate 7516192768 bytes. Error code 12 (Cannot allocate memory)" when
# posix_memalign fails, "DefaultCPUAllocator: not enough memory: you tried to allocate N bytes." when
# malloc returns nothing; raised as a RuntimeError (c10::Error).
_HOST_ALLOCATOR = re.compile(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory): you tried to "
                             r"allocate (\d+) bytes")
_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


class StepOutOfMemory(Exception):
    """A training step ran out of device memory: where, and the original error as __cause__."""

    def __init__(self, step: int, phase: str, memory: str = "device") -> None:
        super().__init__(f"out of {memory} memory at step {step} ({phase})")
        self.step = step
        self.phase = phase
        self.memory = memory
        """"device" (the GPU's, torch.OutOfMemoryError) or "host" (`host_out_of_memory`)."""


def host_out_of_memory(error: BaseException) -> bool:
    """Whether `error` says the host ran out of memory: torch's CPU allocator failed, or Python's own
    allocation did (MemoryError)."""
    return isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and
                                               _HOST_ALLOCATOR.search(str(error)) is not None)


def requested_bytes(message: str) -> int:
    """The failed allocation's size from PyTorch's message (either allocator's); 0 when it does not say."""
    host = _HOST_ALLOCATOR.search(message)
    if host:
        return int(host.group(1))
    match = _REQUEST.search(message)
    return int(float(match.group(1)) * _UNITS[match.group(2)]) if match else 0


def oom_record(plan: RunPlan, rank: Rank, step: int | None, phase: str, error: BaseException,
               memory: str = "device") -> dict[str, Any]:
    """This rank's record (module docstring: what "needed at least" means). `memory`: "device" or
    "host" (then the device figures are not read: they did not run out); `step` None: outside the steps."""
    import torch

    message = str(error) or type(error).__name__
    requested = requested_bytes(message)
    device = rank.device
    allocated = reserved_peak = reserved_now = 0
    if device.type == "cuda" and memory == "device":
        allocated = torch.cuda.max_memory_allocated(device)
        reserved_peak = torch.cuda.max_memory_reserved(device)
        reserved_now = torch.cuda.memory_reserved(device)
    outside = plan.chosen.memory.gpu_outside_allocator
    return {"memory": memory, "rank": rank.rank, "node": rank.node, "step": step, "phase": phase,
            "device": device.type,
            "max_allocated_bytes": allocated, "max_reserved_bytes": reserved_peak,
            "reserved_bytes": reserved_now, "requested_bytes": requested,
            "needed_at_least_bytes": max(reserved_peak, reserved_now + requested) + outside,
            "predicted_bytes": plan.chosen.memory.gpu_total, "strategy": plan.chosen.name,
            "message": message[:2000], "time": time.time()}


def record_oom(plan: RunPlan, rank: Rank, run_dir: Path, step: int | None, phase: str, error: BaseException,
               memory: str = "device") -> None:
    """Write this rank's record and say so on stderr in one line (the launcher relays it)."""
    record = oom_record(plan, rank, step, phase, error, memory)
    path = write_oom_record(run_dir, rank.rank, record)
    where = f"at step {step} ({phase})" if step is not None else phase
    print(f"rank {rank.rank}: out of {memory} memory {where}; recorded in {path}", file=sys.stderr, flush=True)


