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

Each rank also records its allocation history from before its first CUDA allocation to its end
(bench/cuda_trace.py) into RUN_DIR/cuda-trace-rank<R>.json.gz, with the device memory it held outside
the allocator, and marks each training step's start and end in it with a request of an odd size
(`cuda_trace.STEP_MARK_BYTES`, allocated and freed at once): bench/allocator_trace_check.py replays it
through orchestrate's allocator model and reports set-up, steps and what follows apart.
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


def mark_steps() -> None:
    """Each engine's train_step bracketed by two marker requests in the allocation history."""
    import torch

    from bench import cuda_trace
    from orchestrate.backends.deepspeed_backend import DeepSpeedTrainEngine
    from orchestrate.backends.torch_engine import TorchEngine

    def mark() -> None:
        torch.empty(cuda_trace.STEP_MARK_BYTES, dtype=torch.uint8, device="cuda")

    for engine in (TorchEngine, DeepSpeedTrainEngine):
        def marked(self, micro_batches, _step=engine.train_step):
            mark()
            try:
                return _step(self, micro_batches)
            finally:
                mark()

        engine.train_step = marked


def main(argv: list[str]) -> int:
    import torch

    from bench import cuda_trace
    from orchestrate.planner.plan import RunPlan
    from orchestrate.worker.main import main as worker_main

    plan_path = Path(argv[0])
    plan = RunPlan.read(plan_path)
    if not (plan.hardware.has_gpu and torch.cuda.is_available()):
        return worker_main(argv)
    device = int(os.environ.get("LOCAL_RANK", "0"))
    used_before_cuda = cuda_trace.device_used_bytes(device)
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = cap_fraction(plan.hardware.gpu.memory_bytes, total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    cuda_trace.start()
    mark_steps()
    code = 1
    try:
        code = worker_main(argv)
        return code
    finally:
        rank = os.environ.get("RANK", "0")
        try:
            cuda_trace.dump(plan_path.parent / f"cuda-trace-rank{rank}.json.gz", device, used_before_cuda,
                            int(fraction * total), {"strategy": plan.chosen.name, "rank": int(rank), "exit_code": code})
        except Exception as exc:  # noqa: BLE001 - the run's own outcome matters more than its history
            print(f"warning: no allocation history written: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
