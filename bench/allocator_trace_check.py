"""orchestrate's caching-allocator model against the allocator: each recorded CUDA allocation history
(bench/cuda_trace.py: bench/gpu_worker.py's GPU-check runs, bench/cuda_constants.py's small ones)
replayed through orchestrate/simulate/allocator.py with the settings and memory cap it ran under, the
model's allocated and reserved peaks beside torch's own (`memory_stats`).

Usage: python bench/allocator_trace_check.py DIR_OR_FILE [...] [--json FILE]
(the histories measured on an H200 on 2026-12-04 are in bench/results/cuda-traces/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import cuda_trace  # noqa: E402

MiB = 2**20


def trace_files(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for path in paths:
        out += sorted(path.rglob("*.json.gz")) if path.is_dir() else [path]
    return out


def check(path: Path) -> dict:
    record = cuda_trace.read(path)
    row = cuda_trace.replay_trace(record)
    summary = record["summary"]
    row.update(trace=path.name, events=len(record["events"]), truncated=summary.get("truncated", False),
               outside_allocator=summary.get("outside_allocator"), device=summary.get("device_name"),
               torch=summary.get("torch"), cuda=summary.get("cuda"))
    return row


def _ratio(model: int, real: int) -> str:
    return f"{model / real:.3f}" if real else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    files = trace_files(args.paths)
    if not files:
        sys.exit(f"no allocation histories (*.json.gz) under {', '.join(map(str, args.paths))}")
    rows = [check(f) for f in files]
    print(f"{'history':58s} {'settings':26s} {'events':>8s} {'alloc real MiB':>14s} {'model/real':>10s} "
          f"{'reserved real MiB':>17s} {'model/real':>10s} {'retries real/model':>18s} {'outside MiB':>11s}")
    for r in rows:
        outside = f"{r['outside_allocator'] / MiB:,.0f}" if r["outside_allocator"] is not None else "-"
        print(f"{r['trace'][:58]:58s} {(r['settings'] or 'default')[:26]:26s} {r['events']:>8,d} "
              f"{r['real_allocated'] / MiB:>14,.1f} {_ratio(r['model_allocated'], r['real_allocated']):>10s} "
              f"{r['real_reserved'] / MiB:>17,.1f} {_ratio(r['model_reserved'], r['real_reserved']):>10s} "
              f"{r['real_retries']:>9d}/{r['model_retries']:<8d} {outside:>11s}"
              + (f"  model OOM: {r['model_oom']}" if r["model_oom"] else "")
              + (f"  {r['unknown_frees']} frees of unseen blocks" if r["unknown_frees"] else "")
              + ("  (history truncated)" if r["truncated"] else ""))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
