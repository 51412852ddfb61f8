"""What the calibration file records for a finished GPU run, checked on the peaks the H200 session of
2026-12-04 measured (bench/results/h200-2026-12-04, re-planned with today's model): the ratio taken from
the allocated peak follows the run's need (the least memory its recorded allocation history runs in);
the reserved peak, which on a card with room holds the allocator's cache, would not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import cuda_trace, gpu_results
from orchestrate.hardware.profile import HardwareProfile

RESULTS = Path(__file__).resolve().parents[3] / "bench/results/h200-2026-12-04"


@pytest.fixture(scope="module")
def ratios(tmp_path_factory):
    run = json.loads((RESULTS / "gpu_check.json").read_text())
    hw = HardwareProfile.model_validate(run["hardware"])
    out = {}
    for name, row in run["plans"].items():
        plan = gpu_results.replanned(RESULTS, name, hw, tmp_path_factory.mktemp(name))
        needed = cuda_trace.needed_bytes(cuda_trace.read(RESULTS / "traces" / f"zoo-{name}.json.gz"))
        out[name] = gpu_results.calibration_ratios(plan, row["measured"], needed)
    return out


@pytest.mark.slow  # seconds of replays or real tokenizer runs: kept out of the fast tier
def test_the_allocated_peak_gives_each_runs_need_within_two_percent(ratios):
    assert len(ratios) == 5
    for name, (_, allocated, need) in ratios.items():
        assert allocated == pytest.approx(need, rel=0.02), name


@pytest.mark.slow  # shares the fixture that replans every stored run
def test_the_reserved_peak_would_have_raised_zero2_plans_by_a_third(ratios):
    reserved, allocated, need = ratios["zero2-optimizer-offload"]
    assert reserved > 1.3 and need < 1.05 and allocated < 1.05
