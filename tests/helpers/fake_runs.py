"""A run directory as `orchestrate report` reads it, without training: plan.json and metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrate.planner.strategy import Strategy
from tests.helpers.plans import make_plan

DDP = Strategy("ddp", 0, "none", "none", "fp32", False, 2)


def fake_run(path: Path, marked: bool = True) -> Path:
    """`path` with the run marker (unless `marked` is False), a DDP plan and two steps of metrics."""
    from orchestrate.run.layout import write_marker

    path.mkdir(parents=True)
    if marked:
        write_marker(path)
    make_plan(DDP).write(path / "plan.json")
    records = [{"step": s, "loss": 5.0 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64, "tokens_per_s": 100.0,
                "rss_peak_bytes_max_rank": 2**28, "predicted_gpu_bytes_per_rank": 2**27} for s in (1, 2)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
