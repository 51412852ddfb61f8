"""Test-only fault injection: orchestrate's worker with a CUDA-style out-of-memory error raised in
the backward of one step, for tests/unit/launch/test_oom_recovery.py (a CPU machine has no allocator to exhaust).

`python -m tests.helpers.oom_worker RUN_DIR/plan.json`, with (set only by that test):
- ORCHESTRATE_TEST_INJECT_OOM_AT_STEP: the optimizer step whose first backward raises;
- ORCHESTRATE_TEST_INJECT_OOM_REQUEST: the bytes the error says it "Tried to allocate" (on CPU the
  record's measured need, worker/oom.py);
- ORCHESTRATE_TEST_INJECT_OOM_ATTEMPTS: how many launches of the run fail (default 1), counted by the
  out-of-memory corrections the plan carries (one per re-plan);
- ORCHESTRATE_TEST_INJECT_OOM_MEMORY: "device" (default: torch.OutOfMemoryError, as CUDA's allocator
  raises it) or "host" (the RuntimeError torch's CPU allocator raises when malloc fails,
  c10/core/impl/alloc_cpu.cpp).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    import torch

    from orchestrate.planner.plan import RunPlan
    from orchestrate.worker import stages
    from orchestrate.worker.main import main as worker_main

    plan = RunPlan.read(Path(argv[0]))
    fail_at = int(os.environ["ORCHESTRATE_TEST_INJECT_OOM_AT_STEP"])
    request = int(os.environ["ORCHESTRATE_TEST_INJECT_OOM_REQUEST"])
    attempts = int(os.environ.get("ORCHESTRATE_TEST_INJECT_OOM_ATTEMPTS", "1"))
    host = os.environ.get("ORCHESTRATE_TEST_INJECT_OOM_MEMORY", "device") == "host"
    replans = sum(c.source.startswith("out-of-memory") for c in plan.hardware.memory_corrections)
    accumulation = plan.chosen.gradient_accumulation
    state = {"start": 0, "backwards": 0}

    resume = stages.resume

    def resume_and_note_start(*args, **kwargs):
        checkpointer, start_step = resume(*args, **kwargs)
        state["start"] = start_step
        return checkpointer, start_step

    backward = torch.Tensor.backward

    def failing_backward(self, *args, **kwargs):
        step = state["start"] + state["backwards"] // accumulation + 1
        first_of_step = state["backwards"] % accumulation == 0
        state["backwards"] += 1
        if step == fail_at and first_of_step and replans < attempts:
            if host:
                raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {request} "
                                   "bytes. Error code 12 (Cannot allocate memory)")
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {request} bytes. "
                                         "(injected by tests/helpers/oom_worker.py)")
        return backward(self, *args, **kwargs)

    stages.resume = resume_and_note_start
    torch.Tensor.backward = failing_backward
    return worker_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
