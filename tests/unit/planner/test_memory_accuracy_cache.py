"""The committed simulation cache of bench/memory_accuracy.py covers both zoos as the planner and the
spec keys are now: every point is a cache hit with its allocator replay, the analytical model stays
within 5 % of the cached simulations, and the planner's allocator reserve covers what the replayed
caching allocator needs at every point, per backend and expandable_segments setting, and is the table
bench/allocator_reserve_fit.py fits to them (docs/memory-model.md quotes these numbers). A change to RunSpec, Strategy or the plans that alters
the keys makes this fail until the cache is re-keyed or re-simulated."""

from __future__ import annotations

import pytest


@pytest.mark.slow  # seconds of replays or real tokenizer runs: kept out of the fast tier
@pytest.mark.parametrize("args", [[], ["--lora"]], ids=["full", "lora"])
def test_every_zoo_point_is_cached_and_within_five_percent(args, tmp_path):
    import json

    from bench.memory_accuracy import covered, lora_zoo, main, zoo

    out = tmp_path / "rows.json"
    assert main(["--cached-only", "--jobs", "1", "--json", str(out), *args]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == len(lora_zoo() if args else zoo())  # no point missing from the cache
    worst = max(abs(r["ratio"] - 1) for r in rows)
    assert worst <= 0.05, worst
    assert all(r["allocator"] for r in rows)  # every point replayed through the allocator model
    short = [(r["family"], r["strategy"], r["seq"], name) for r in rows for name, on in
             (("segments", False), ("expandable", True)) if not covered(r, name, on)]
    assert short == []


def test_the_key_holds_the_rendered_zero3_settings():
    # A cached simulation must not outlive a change of what DeepSpeed runs with: the key hashes the
    # whole rendered config, stage3_max_live_parameters / stage3_max_reuse_distance included.
    import dataclasses

    from bench.memory_accuracy import Point, spec_key, strategy
    from orchestrate.simulate.in_subprocess import make_spec

    spec = make_spec(Point("llama", strategy("deepspeed", 3, 1, False), 512).plan())
    zero = spec.deepspeed_config["zero_optimization"]
    assert zero["stage3_max_live_parameters"] < 10**9 and zero["stage3_max_reuse_distance"] < 10**9
    for knob in ("stage3_max_live_parameters", "stage3_max_reuse_distance"):
        changed = {**spec.deepspeed_config, "zero_optimization": {**zero, knob: 10**9}}
        assert spec_key(dataclasses.replace(spec, deepspeed_config=changed)) != spec_key(spec)


@pytest.mark.slow  # seconds of replays or real tokenizer runs: kept out of the fast tier
def test_the_planned_reserve_is_the_fit_over_every_replayed_point():
    # planner/allocator_reserve.py holds what bench/allocator_reserve_fit.py fits to the cached replays
    # (both zoos and the 8- and 16-block points): a re-simulation that moves a point moves the table, or fails here.
    from bench.allocator_reserve_fit import fitted
    from orchestrate.planner.allocator_reserve import RESERVE

    assert fitted() == RESERVE
