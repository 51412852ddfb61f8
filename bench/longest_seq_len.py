"""The longest train.seq_len (a multiple of 64) at which some strategy fits, for SFT and for DPO of
the same model on the same hardware, by bisection over `orchestrate plan` (the analytical model only).

    .venv/bin/python bench/longest_seq_len.py [--config examples/llama3-8b.yaml] [--method qlora]
                                              [--gpus 1] [--gpu-mem 8GiB] [--cpu-mem 32GiB]
"""

from __future__ import annotations

import argparse

from orchestrate import api
from orchestrate.hardware.flags import HardwareFlags
from orchestrate.planner.plan import RunPlan
from orchestrate.planning import plan_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/llama3-8b.yaml")
    parser.add_argument("--method", default="qlora")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--gpu-mem", default="8GiB")
    parser.add_argument("--cpu-mem", default="32GiB")
    args = parser.parse_args()
    hw = HardwareFlags(gpus=args.gpus, gpu_mem=args.gpu_mem, cpu_mem=args.cpu_mem).resolve()

    def chosen(seq_len: int, extra: list[str]):
        config = api.load_config(args.config, [f"train.method={args.method}", f"train.seq_len={seq_len}", *extra])
        plan = plan_for(config, hw)
        return plan.chosen if isinstance(plan, RunPlan) else None

    for name, extra in (("sft", []), ("dpo", ["preference.loss=dpo"])):
        low, high = 0, (8192 // 64 if chosen(64, extra) else 0)
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if chosen(64 * middle, extra) else (low, middle - 1)
        best = chosen(64 * low, extra) if low else None
        print(f"{name}: longest seq_len {64 * low}" + (f" ({best.name}, {best.memory.gpu_total / 2**30:.1f} GiB/GPU)"
                                                      if best else ""))


if __name__ == "__main__":
    main()
