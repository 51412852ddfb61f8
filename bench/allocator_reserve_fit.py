"""Fit the planner's allocator reserve (orchestrate/planner/allocator_reserve.py) to the simulation zoo
replayed through the CUDA caching-allocator model.

    .venv/bin/python bench/allocator_reserve_fit.py          # cached simulations only (bench/results/)
    .venv/bin/python bench/allocator_reserve_fit.py --short  # llama, seq 512, micro-batch 1 only (CI)

Points: the full zoo and the LoRA zoo of bench/memory_accuracy.py, and 8- and 16-block llama / qwen2 at
seq 512, micro-batch 1 (`memory_accuracy.py --layers 8 --family llama --family qwen2 --seq 512 --mb 1`,
and `--layers 16`), so depth is covered too (16-block llama under DDP asks for 15.6 GiB). Per backend
and expandable_segments setting the reserve is a constant plus a fraction of the states
(allocator_reserve.STATE_TERMS, as the analytical model has them for the point) and another of the rest;
it must cover every point (`needed - requested`, needed being the least device memory the replayed
allocator runs in). Of the triples that do, the fit takes the one with the smallest reserve for a 6 GiB
request of which 2 GiB are transient (a plan on an 8 GB card), with the constant at least the page
slack of the backend's streams and each fraction at least 1 % (beyond the zoo's sizes, 0.4-16 GiB,
predict high). Prints the table planner/allocator_reserve.py holds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.memory_accuracy import CACHE, Cache, analytical, lora_zoo, zoo  # noqa: E402
from orchestrate.planner.allocator_reserve import RESERVE, state_bytes  # noqa: E402

MiB, GiB = 2**20, 2**30
PAGE_SLACK_BYTES = 22 * MiB
"""Per stream: one partly used 20 MiB large page (or 1-10 MiB requests' segment) and a 2 MiB small one
(kLargeBuffer, kSmallBuffer in c10/cuda/CUDACachingAllocator.cpp), which no other stream may use."""
STREAMS = {"ddp": 1, "fsdp": 3, "deepspeed": 1}
"""Streams that allocate, as the replay sees them: FSDP2 its default, all-gather copy-in and
reduce-scatter streams (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py); DDP and DeepSpeed
the default one (DeepSpeed's side streams are not seen by a CPU simulation: docs/memory-model.md)."""
TYPICAL, TYPICAL_TRANSIENT = 6 * GiB, 2 * GiB
STEPS = 200  # fractions in steps of 0.5 %
FLOOR, STATES_CEILING = 2, 120  # 1 %, 60 %


def points(short: bool = False):
    """Every point the fit covers; `short`: the 2-block llama ones at seq 512, micro-batch 1 (one per
    strategy and activation-checkpointing setting), whose fit must reserve no more than the planner does."""
    if short:
        return zoo(["llama"], (512,), (1,))
    deeper = [point for layers in (8, 16) for point in zoo(["llama", "qwen2"], (512,), (1,), layers=layers)]
    return [*zoo(), *lora_zoo(), *deeper]


def fit(overheads: list[tuple[int, float, int]], least_constant: int) -> tuple[int, float, float]:
    """(constant in MiB, fraction of states, fraction of transient bytes) covering every
    (requested, states, needed - requested)."""
    requested, states, over = (np.array(column, dtype=float) for column in zip(*overheads, strict=True))
    states = np.minimum(states, requested)
    transient = requested - states
    of_states = np.arange(FLOOR, STATES_CEILING + 1)[:, None]  # one row per fraction of states
    best = None
    for constant in range(least_constant // MiB, 2049, 2):
        left = over - constant * MiB - of_states / STEPS * states
        worst = np.max(left / np.maximum(transient, 1.0), axis=1)
        of_transient = np.maximum(FLOOR, np.ceil(worst * STEPS))
        cost = (constant * MiB + of_states[:, 0] / STEPS * (TYPICAL - TYPICAL_TRANSIENT)
                + of_transient / STEPS * TYPICAL_TRANSIENT)
        i = int(np.argmin(cost))
        if best is None or cost[i] < best[0]:
            best = (cost[i], constant, int(of_states[i, 0]) / STEPS, int(of_transient[i]) / STEPS)
    return best[1:]


def overheads(short: bool = False) -> dict[tuple[str, bool], list[tuple[int, float, int]]]:
    """(requested, states, needed - requested) of every point, by backend and expandable_segments setting."""
    cache, out = Cache(CACHE), {}
    for point in points(short):
        plan = point.plan()
        sim, _ = cache.get_or_run(point, run=False, plan=plan)
        if sim is None or not sim.allocator:
            raise LookupError(f"not simulated with the replay: {point.family} {point.strategy.name} "
                              f"seq {point.seq_len} ({point.layers} blocks); run bench/memory_accuracy.py")
        states = state_bytes(analytical(point, plan))
        for name, on in (("segments", False), ("expandable", True)):
            a = sim.allocator[name]
            out.setdefault((point.strategy.backend, on), []).append(
                (a["requested"], states, a["needed"] - a["requested"]))
    return out


def fitted() -> dict[str, dict[bool, tuple[int, float, float]]]:
    """The table of planner/allocator_reserve.py, from the cached replays."""
    table: dict[str, dict[bool, tuple[int, float, float]]] = {}
    for (backend, on), triples in overheads().items():
        table.setdefault(backend, {})[on] = fit(triples, STREAMS[backend] * PAGE_SLACK_BYTES)
    return table


def _reserve(triple: tuple[int, float, float], nbytes: float, transient: float) -> float:
    constant, of_states, of_transient = triple
    return constant * MiB + of_states * (nbytes - transient) + of_transient * transient


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="llama at seq 512, micro-batch 1 only")
    every = overheads(parser.parse_args(argv).short)
    print(f"{sum(map(len, every.values())) // 2} points; backend, expandable_segments: fitted (constant MiB, "
          f"fraction of states, of transient bytes), planned, reserve for {TYPICAL // GiB} GiB "
          f"({TYPICAL_TRANSIENT // GiB} GiB transient) fitted / planned, largest overhead")
    for (backend, on), triples in sorted(every.items()):
        triple = fit(triples, STREAMS[backend] * PAGE_SLACK_BYTES)
        planned = RESERVE[backend][on]
        top = max(triples, key=lambda x: x[2] / x[0])
        print(f"{backend:<10} {str(on):<6} {len(triples):>4} points: {triple}, planned {planned}, "
              f"{_reserve(triple, TYPICAL, TYPICAL_TRANSIENT) / MiB:.0f} / "
              f"{_reserve(planned, TYPICAL, TYPICAL_TRANSIENT) / MiB:.0f} MiB; largest share "
              f"{top[2] / MiB:.0f} MiB on {top[0] / MiB:.0f} MiB requested ({top[1] / MiB:.0f} of states)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
