"""Fit the planner's allocator reserve (orchestrate/planner/allocator_reserve.py) to the simulation zoo
replayed through the CUDA caching-allocator model.

    .venv/bin/python bench/allocator_reserve_fit.py      # cached simulations only (bench/results/)

Points: the full zoo and the LoRA zoo of bench/memory_accuracy.py, and 8- and 16-block llama / qwen2 at
seq 512, micro-batch 1 (`memory_accuracy.py --layers 8 --family llama --family qwen2 --seq 512 --mb 1`,
and `--layers 16`), so depth is covered too (16-block llama under DDP asks for 15.6 GiB). Per backend and expandable_segments setting the reserve is a constant plus a
fraction of the bytes requested; it must cover every point (`needed - requested`, needed being the
least device memory the replayed allocator runs in). Of the (constant, fraction) pairs that do, the
fit takes the one with the smallest reserve for a 6 GiB request (a plan on an 8 GB card), with the
constant at least the page slack of the backend's streams and the fraction at least 1 % (beyond the
zoo's sizes, 0.4-10 GiB, predict high). Prints the table planner/allocator_reserve.py holds.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.memory_accuracy import CACHE, Cache, lora_zoo, zoo  # noqa: E402
from orchestrate.planner.allocator_reserve import RESERVE  # noqa: E402

MiB, GiB = 2**20, 2**30
PAGE_SLACK_BYTES = 22 * MiB
"""Per stream: one partly used 20 MiB large page (or 1-10 MiB requests' segment) and a 2 MiB small one
(kLargeBuffer, kSmallBuffer in c10/cuda/CUDACachingAllocator.cpp), which no other stream may use."""
STREAMS = {"ddp": 1, "fsdp": 3, "deepspeed": 1}
"""Streams that allocate, as the replay sees them: FSDP2 its default, all-gather copy-in and
reduce-scatter streams (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py); DDP and DeepSpeed
the default one (DeepSpeed's side streams are not seen by a CPU simulation: docs/memory-model.md)."""
TYPICAL = 6 * GiB
FLOOR = 0.01


def points():
    deeper = [point for layers in (8, 16) for point in zoo(["llama", "qwen2"], (512,), (1,), layers=layers)]
    return [*zoo(), *lora_zoo(), *deeper]


def fit(overheads: list[tuple[int, int]], least_constant: int) -> tuple[int, float]:
    """(constant in MiB, fraction) covering every (requested, needed - requested)."""
    best = None
    for constant in range(least_constant // MiB, 513, 2):
        worst = max((over - constant * MiB) / requested for requested, over in overheads)
        fraction = math.ceil(max(FLOOR, worst) * 200) / 200
        cost = constant * MiB + fraction * TYPICAL
        if best is None or cost < best[0]:
            best = (cost, constant, fraction)
    return best[1], best[2]


def overheads() -> dict[tuple[str, bool], list[tuple[int, int]]]:
    """(requested, needed - requested) of every point, by backend and expandable_segments setting."""
    cache, out = Cache(CACHE), {}
    for point in points():
        sim, _ = cache.get_or_run(point, run=False)
        if sim is None or not sim.allocator:
            raise LookupError(f"not simulated with the replay: {point.family} {point.strategy.name} "
                              f"seq {point.seq_len} ({point.layers} blocks); run bench/memory_accuracy.py")
        for name, on in (("segments", False), ("expandable", True)):
            a = sim.allocator[name]
            out.setdefault((point.strategy.backend, on), []).append((a["requested"], a["needed"] - a["requested"]))
    return out


def fitted() -> dict[str, dict[bool, tuple[int, float]]]:
    """The table of planner/allocator_reserve.py, from the cached replays."""
    table: dict[str, dict[bool, tuple[int, float]]] = {}
    for (backend, on), pairs in overheads().items():
        table.setdefault(backend, {})[on] = fit(pairs, STREAMS[backend] * PAGE_SLACK_BYTES)
    return table


def main() -> int:
    every = overheads()
    print(f"{sum(map(len, every.values())) // 2} points; backend, expandable_segments: fitted (constant MiB, "
          f"fraction), planned, reserve for {TYPICAL // GiB} GiB fitted / planned, largest overhead")
    for (backend, on), pairs in sorted(every.items()):
        constant, fraction = fit(pairs, STREAMS[backend] * PAGE_SLACK_BYTES)
        planned = RESERVE[backend][on]
        top = max(pairs, key=lambda x: x[1] / x[0])
        print(f"{backend:<10} {str(on):<6} {len(pairs):>4} points: ({constant}, {fraction:.3f}), planned "
              f"{planned}, {(constant * MiB + fraction * TYPICAL) / MiB:.0f} / "
              f"{(planned[0] * MiB + planned[1] * TYPICAL) / MiB:.0f} MiB; largest share "
              f"{top[1] / MiB:.0f} MiB on {top[0] / MiB:.0f} MiB requested")
    return 0


if __name__ == "__main__":
    sys.exit(main())
