"""Published GPU memory measurements of real training runs, re-planned with orchestrate's memory model
pinned to each source's stated settings (hardware, library versions, strategy), compared like with like:

- max_memory_allocated: the prediction without the allocator reserve, the CUDA context and NCCL's own
  buffers (none of them is a torch allocation);
- max_memory_reserved: with the allocator reserve (the caching allocator's segments), without context
  and NCCL;
- nvidia-smi: everything, the CUDA context and NCCL buffers included.

Pure and fast (no GPU, no download): `python bench/published_peaks.py [--json FILE]` prints one row per
case, the median and worst ratio predicted / published per metric kind, and each case's residual in a
line. Cases whose settings cannot be reproduced by a plan are listed with the reason and not counted.
The cases, their sources and settings: bench/published_cases.py. tests/unit/planner/test_published_peaks.py runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.published_cases import ALLOCATED, CASES, FSDP1_OVER_FSDP2, RESERVE_PAIRS, RESERVED, SMI, Case  # noqa: E402, F401  (Case: for callers building variants)
from orchestrate.config.schema import RunConfig  # noqa: E402
from orchestrate.hardware.profile import HardwareProfile  # noqa: E402
from orchestrate.hardware.units import GiB  # noqa: E402
from orchestrate.methods.registry import method_terms  # noqa: E402
from orchestrate.model.meta import shape_for  # noqa: E402
from orchestrate.planner.allocator_reserve import state_bytes  # noqa: E402
from orchestrate.planner.estimate import MemoryEstimate  # noqa: E402
from orchestrate.planner.memory import estimate_memory  # noqa: E402


def _hardware(case: Case) -> HardwareProfile:
    # No source sets PYTORCH_CUDA_ALLOC_CONF: torch's default, expandable segments off (none before torch 2.1).
    return HardwareProfile(name=case.name, gpus_per_node=case.gpus, gpu=case.gpu, cpu_memory_bytes=256 * GiB,
                           software=case.software, expandable_segments=False)


def _config(case: Case) -> RunConfig:
    model = {"architecture": case.architecture, "task": case.task}
    if case.num_labels is not None:
        model["num_labels"] = case.num_labels
    return RunConfig.model_validate({"model": model, "train": case.train})


def comparable_bytes(memory: MemoryEstimate, case: Case) -> float:
    """The prediction of what `case.metric` measures (module doc); a sharded FSDP1 run's allocations carry
    FSDP1's measured excess over FSDP2 (published_cases.FSDP1_OVER_FSDP2)."""
    if case.metric == ALLOCATED:
        return memory.gpu_tensors * (FSDP1_OVER_FSDP2[ALLOCATED] if case.sharded_fsdp1 else 1)
    reserved = memory.gpu_allocator * (FSDP1_OVER_FSDP2[RESERVED] if case.sharded_fsdp1 else 1)
    return reserved + (memory.gpu_outside_allocator if case.metric == SMI else 0)


def _inputs(case: Case) -> tuple:
    config = _config(case)
    shape = shape_for(config)
    hardware = _hardware(case)
    return shape, hardware, case.strategy, case.train["seq_len"], case.accumulation, method_terms(config, shape, hardware)


def evaluate(case: Case) -> dict:
    memory = estimate_memory(*_inputs(case))
    predicted = comparable_bytes(memory, case)
    return {"name": case.name, "source": case.source, "metric": case.metric, "published_gib": case.published_bytes / GiB,
            "predicted_gib": predicted / GiB, "ratio": predicted / case.published_bytes,
            "reserve_gib": memory.gpu["allocator_reserve"] / GiB, "left_out": case.left_out,
            "room": 1 - case.published_bytes / case.gpu.memory_bytes,
            "residual": case.residual, "unpinned": case.unpinned, "settings": case.settings,
            "strategy": case.strategy.name, "fsdp1": case.fsdp1}


def measured_reserves() -> list[dict]:
    """Reserved (or nvidia-smi less context and NCCL) over allocated, where a source published both, and
    the planner's reserve over its allocated prediction for the same run."""
    by_name = {case.name: case for case in CASES}
    out = []
    for allocated_name, other_name in RESERVE_PAIRS:
        allocated, other = by_name[allocated_name], by_name[other_name]
        memory = estimate_memory(*_inputs(other))
        reserved = other.published_bytes - (memory.gpu_outside_allocator if other.metric == SMI else 0)
        as_fsdp2_allocated = replace(other, metric=ALLOCATED, fsdp1=False)  # the terms as the model has them
        predicted = (comparable_bytes(memory, replace(other, metric=RESERVED))
                     / comparable_bytes(memory, replace(other, metric=ALLOCATED)))
        out.append({"run": other_name, "engine": "FSDP1" if other.fsdp1 else "FSDP2" if other.strategy.backend == "fsdp" else "one GPU",
                    "fraction": reserved / allocated.published_bytes - 1, "predicted": predicted - 1,
                    "transient": 1 - state_bytes(memory.gpu) / comparable_bytes(memory, as_fsdp2_allocated)})
    return out


TIGHT_ROOM = 0.20
"""A card with less than this share of its memory left at the published peak: the allocator had little
room to keep cache, so a reserved or nvidia-smi peak there is close to the need the planner predicts."""


def by_room(rows: list[dict]) -> dict[str, dict]:
    """The counted reserved and nvidia-smi rows' ratios, on cards with little room left and with more."""
    held = [r for r in rows if not r["left_out"] and r["metric"] != ALLOCATED]
    out = {}
    for label, tight in ((f"room < {TIGHT_ROOM:.0%}", True), (f"room >= {TIGHT_ROOM:.0%}", False)):
        part = [r for r in held if (r["room"] < TIGHT_ROOM) == tight]
        ratios = [r["ratio"] for r in part]
        out[label] = {"cases": len(ratios), "median": statistics.median(ratios), "min": min(ratios),
                      "max": max(ratios), "below_0.95": [r["name"] for r in part if r["ratio"] < 0.95]}
    return out


def summary(rows: list[dict], without_fsdp1: bool = False) -> dict:
    """Median and worst (lowest, highest) ratio per metric kind over the counted cases (`without_fsdp1`:
    the rows of runs on FSDP1, which orchestrate plans as FSDP2, aside)."""
    counted = [r for r in rows if not r["left_out"] and not (without_fsdp1 and r["fsdp1"])]
    out = {}
    for metric in sorted({r["metric"] for r in counted}):
        ratios = [r["ratio"] for r in counted if r["metric"] == metric]
        out[metric] = {"cases": len(ratios), "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every row and the summary here")
    args = parser.parse_args(argv)
    rows = [evaluate(case) for case in CASES]
    print(f"{'case':40} {'metric':21} {'published':>10} {'predicted':>10} {'ratio':>6}  (GiB)")
    for r in rows:
        mark = "  [left out]" if r["left_out"] else ""
        print(f"{r['name']:40} {r['metric']:21} {r['published_gib']:10.2f} {r['predicted_gib']:10.2f} {r['ratio']:6.3f}{mark}")
    counted = [r for r in rows if not r["left_out"]]
    sources = sorted({r["source"] for r in counted})
    print(f"\n{len(counted)} cases counted from {len(sources)} sources; {len(rows) - len(counted)} left out")
    result = summary(rows)
    for metric, s in result.items():
        print(f"{metric:21} cases {s['cases']:2}  median {s['median']:.3f}  worst low {s['min']:.3f}  high {s['max']:.3f}")
    print("the FSDP1 rows aside (orchestrate runs FSDP2):")
    for metric, s in summary(rows, without_fsdp1=True).items():
        print(f"{metric:21} cases {s['cases']:2}  median {s['median']:.3f}  worst low {s['min']:.3f}  high {s['max']:.3f}")
    print("\nreserved and nvidia-smi rows by the room the card had left at the published peak (1 - published / "
          "capacity): with little room the allocator cannot keep cache beside the need")
    for label, s in by_room(rows).items():
        print(f"{label:21} cases {s['cases']:2}  median {s['median']:.3f}  worst low {s['min']:.3f}  high {s['max']:.3f}"
              f"  below 0.95: {', '.join(s['below_0.95']) or 'none'}")
    print("\nreserve over allocated, measured (reserved, or nvidia-smi less the modelled context and NCCL) and "
          "planned, with the planned transient share of allocated:")
    for m in measured_reserves():
        print(f"- {m['run']:38} {m['engine']:8} measured {100 * m['fraction']:5.1f} %  planned {100 * m['predicted']:5.1f} %"
              f"  transient {100 * m['transient']:3.0f} %")
    print("\nsources (and what none of their cases could pin):")
    for source in dict.fromkeys(r["source"] for r in rows):
        unpinned = next((r["unpinned"] for r in rows if r["source"] == source and r["unpinned"]), "")
        print(f"- {source}" + (f"\n    unpinned: {unpinned}" if unpinned else ""))
    print("\nresidual per case (left out: why):")
    for r in rows:
        print(f"- {r['name']}: " + (f"[left out] {r['left_out']}" if r["left_out"] else r["residual"]))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": result, "sources": sources}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
