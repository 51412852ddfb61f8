"""orchestrate's worker with the GPU capped at the plan's GPU memory (bench/gpu_check.py only).

`python -m bench.gpu_worker RUN_DIR/plan.json` caps this process's CUDA caching allocator at the
memory of the GPU the plan was made for (plan.hardware.gpu.memory_bytes, e.g. 8 GiB), as a fraction
of the real card's memory, then runs `orchestrate.worker.main.main` unchanged.

Why here and not in the launcher: `torch.cuda.set_per_process_memory_fraction` holds for the
calling process only, and torchrun starts fresh worker processes, so a cap set by the launcher (or
bench/gpu_check.py) never reaches them. Why from the plan: plan.json is the only channel from
launcher to worker (docs/DEVELOPING.md: no settings through environment variables), and it already
says how big the GPU is that the plan must fit. LOCAL_RANK is torchrun's own variable.

The cap covers what the caching allocator hands out (what torch.cuda.max_memory_reserved counts);
the CUDA context, cuBLAS workspace and NCCL buffers are allocated outside it, so a plan that fits
the cap can still need a little more of a real 8 GB card.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def cap_fraction(plan_gpu_bytes: int, device_total_bytes: int) -> float:
    """The fraction of the real card that equals the planned card's memory (at most all of it)."""
    if plan_gpu_bytes <= 0 or device_total_bytes <= 0:
        raise ValueError(f"bad memory sizes: planned {plan_gpu_bytes}, device {device_total_bytes}")
    return min(1.0, plan_gpu_bytes / device_total_bytes)


def main(argv: list[str]) -> int:
    import torch

    from orchestrate.planner.plan import RunPlan
    from orchestrate.worker.main import main as worker_main

    plan = RunPlan.read(Path(argv[0]))
    if plan.hardware.has_gpu and torch.cuda.is_available():
        device = int(os.environ.get("LOCAL_RANK", "0"))
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_fraction(plan.hardware.gpu.memory_bytes, total), device)
    return worker_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
