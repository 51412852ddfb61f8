"""Published GPU measurements re-planned by the memory model (bench/published_peaks.py, cases in
bench/published_cases.py): the script runs pure and fast, every case names its source, metric, settings
and residual (or why it is left out), and the ratios are what the model predicts for those settings;
the accuracy bounds are checked (and not yet met: strict xfail)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _bench():
    spec = importlib.util.spec_from_file_location("published_peaks", ROOT / "bench" / "published_peaks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["published_peaks"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows():
    bench = _bench()
    return bench, [bench.evaluate(case) for case in bench.CASES]


def test_every_case_is_sourced_and_compared_like_with_like(rows):
    bench, evaluated = rows
    counted = [r for r in evaluated if not r["left_out"]]
    assert len(counted) >= 20 and len({r["source"] for r in counted}) >= 4
    for r in evaluated:
        assert r["source"] and r["settings"] and r["metric"] in ("max_memory_allocated", "max_memory_reserved", "nvidia-smi")
        assert r["left_out"] or r["residual"], r["name"]  # each counted case explains its ratio
        assert 0.3 < r["ratio"] < 2.0, r  # a planning error, not a model residual
    # nvidia-smi includes the CUDA context (1,343 MiB measured on that stack); reserved excludes it.
    smi = next(c for c in bench.CASES if c.metric == "nvidia-smi")
    reserved = bench.Case(**{**smi.__dict__, "metric": "max_memory_reserved"})
    allocated = bench.Case(**{**smi.__dict__, "metric": "max_memory_allocated"})
    a, r, s = (bench.evaluate(c)["predicted_gib"] for c in (allocated, reserved, smi))
    assert a < r < s and abs((s - r) * 1024 - 1343) < 1


def test_the_script_prints_a_row_per_case_and_the_summary(capsys):
    assert _bench().main([]) == 0
    out = capsys.readouterr().out
    assert "median" in out and "bert-large bs4 fp32" in out and "left out" in out


@pytest.mark.xfail(strict=True, reason="the bounds are not met: medians (allocated 1.008, reserved 1.011, nvidia-smi "
                   "1.013) and highs (1.063, 1.138, 1.082) meet them; six rows sit below 0.95: five FSDP1 runs (the PEFT "
                   "docs' 70B CPU-offload nvidia-smi row 0.77, Answer.AI's 7B QLoRA at seq 512 0.87, whose reserved peak is "
                   "that of seq 2048, untraced) and torchtitan's FSDP2 reserved peak on a card with room (0.87: cache "
                   "beyond the need the reserve predicts); on cards more than 80 % full only the PEFT 70B offload row is below "
                   "0.95; docs/known-gaps.md")
def test_predictions_are_within_the_published_peaks_bounds(rows):
    bench, evaluated = rows
    counted = [r for r in evaluated if not r["left_out"]]
    assert len(counted) >= 20 and len({r["source"] for r in counted}) >= 4
    for metric, s in bench.summary(evaluated).items():
        assert 0.97 <= s["median"] <= 1.05 and s["min"] >= 0.95 and s["max"] <= 1.15, metric


def test_on_nearly_full_cards_only_the_peft_70b_offload_row_is_under_the_published_peak(rows):
    # A reserved or nvidia-smi peak on a card with room holds cache the run did not need; with under
    # 20 % of the card left there is little, and those rows are the need the planner predicts.
    bench, evaluated = rows
    split = bench.by_room(evaluated)
    tight, roomy = split["room < 20%"], split["room >= 20%"]
    assert tight["cases"] >= 10 and roomy["cases"] >= 10
    assert tight["below_0.95"] == ["llama2-70b qlora fsdp offload"]
    assert 0.97 <= tight["median"] <= 1.05 and tight["max"] <= 1.15


def test_measured_reserves_pair_a_published_allocated_peak_with_its_reserved_one(rows):
    bench, _ = rows
    measured = bench.measured_reserves()
    assert len(measured) == len(bench.RESERVE_PAIRS) >= 8
    assert all(0 < m["fraction"] < 1 for m in measured), measured  # reserved above allocated, below 2x


def test_fsdp1_runs_carry_fsdp1s_measured_excess_over_fsdp2_only_when_sharded(rows):
    bench, _ = rows
    by_name = {case.name: case for case in bench.CASES}
    for name, sharded in (("llama2-7b lora fsdp bs4 2048", True), ("llama2-7b lora no_shard bs4 2048", False),
                          ("mistral-7b lora fsdp bs4 (alloc)", True), ("mistral-7b lora bs4 (alloc)", False)):
        case = by_name[name]
        as_fsdp2 = bench.evaluate(bench.Case(**{**case.__dict__, "fsdp1": False}))["predicted_gib"]
        factor = bench.FSDP1_OVER_FSDP2[case.metric] if sharded else 1.0
        assert bench.evaluate(case)["predicted_gib"] == pytest.approx(as_fsdp2 * factor), name
    # torchtitan PR #165's FSDP1 rows define the factor, so they repeat the FSDP2 rows' ratios and are not counted.
    evaluated = {r["name"]: r for r in rows[1]}
    for metric in ("active", "reserved"):
        fsdp1, fsdp2 = evaluated[f"llama-7b full fsdp1 8xH100 ({metric})"], evaluated[f"llama-7b full fsdp2 8xH100 ({metric})"]
        assert fsdp1["left_out"] and not fsdp2["left_out"]
        assert fsdp1["ratio"] == pytest.approx(fsdp2["ratio"])


def test_the_planned_reserve_ranks_one_sources_runs_as_their_measured_reserves_do(rows):
    """fms-acceleration published allocated and nvidia-smi peaks of the same Mistral-7B runs: the reserve
    they held grew with the share of activations, and so does the planned one (a constant plus a fraction
    of the states and a larger one of the transient bytes); one fraction of everything would rank them
    the other way (its constant weighs most on the smallest run)."""
    bench, _ = rows
    measured = [m for m in bench.measured_reserves() if m["run"].startswith("mistral-7b")]
    for engine in ("one GPU", "FSDP1"):
        runs = sorted((m for m in measured if m["engine"] == engine), key=lambda m: m["fraction"])
        assert len(runs) >= 2
        assert [m["predicted"] for m in runs] == sorted(m["predicted"] for m in runs), runs
        assert [m["transient"] for m in runs] == sorted(m["transient"] for m in runs), runs
