"""Every runnable bench runs here in its short mode, in-process (`main([...])`), so a refactor cannot break
one unseen: the benchmarks themselves run rarely. Each test checks what the bench is for (its table's
rows, the ratio it reports, its figures' relations), not only that it ran. bench/README.md lists which
test runs which bench; the multi-process ones are slow (each starts ranks or launches the demo)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_overhead_short_compares_orchestrates_start_up_with_accelerate_launch(tmp_path, capsys):
    """bench/overhead.py --short --only ddp: both rows measured, the start-up ratio reported (its
    hand-written arm reads the files orchestrate wrote through the plan's typed `files`)."""
    from bench.overhead import SHORT_STEPS, main

    out = tmp_path / "overhead.json"
    assert main(["--short", "--only", "ddp", "--out", str(tmp_path / "work"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = ["orchestrate ddp", "accelerate launch (ddp)"]
    assert list(result["tokens_per_s"]) == rows and list(result["first_step_s"]) == rows
    assert all(len(v) == 1 and v[0] > 0 for v in [*result["tokens_per_s"].values(), *result["first_step_s"].values()])
    (ratio,) = result["ratios"].values()
    assert ratio["median"] > 0
    assert "start-up vs accelerate" in capsys.readouterr().out
    metrics = (tmp_path / "work" / "orchestrate-ddp-0" / "metrics.jsonl").read_text().splitlines()
    assert sum("loss" in json.loads(line) for line in metrics) >= SHORT_STEPS
