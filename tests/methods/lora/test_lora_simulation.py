"""LoRA under the fake-tensor simulation (the backends' peft transform before wrapping) against the
planner's adapter terms; QLoRA's NF4 weights against real quantized bytes (bench/qlora_pieces.py)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_lora_zoo_points_are_within_five_percent_of_the_simulation():
    # Points of `bench/memory_accuracy.py --lora` (2-block models, two generic 8 GB GPUs, r=16 on every
    # block linear): DDP on Llama widths, FSDP2 full shard with checkpointing on Qwen2 widths (tied 152k
    # vocabulary), ZeRO-3 on Mistral widths. Simulated here, not read from the cache.
    from bench.memory_accuracy import LORA, Point, compare, strategy
    from orchestrate.simulate.in_subprocess import make_spec, simulate_all

    points = [Point("llama", strategy("ddp", 0, 1, False), 512, LORA),
              Point("qwen2", strategy("fsdp", 3, 1, True), 512, LORA),
              Point("mistral", strategy("deepspeed", 3, 1, False), 512, LORA)]
    specs = [make_spec(point.plan()) for point in points]
    assert all(spec.adapters is not None and spec.adapters["method"] == "lora" for spec in specs)
    for point, sim in zip(points, simulate_all(specs), strict=True):
        row = compare(point, sim)
        assert abs(row["ratio"] - 1) <= 0.05, row


def test_planner_nf4_term_matches_the_real_quantized_bytes():
    # Real CPU tensors through the backends' QLoRA transform: packed codes + absmax + nested absmax +
    # code books. The planner's 4.127 bits/param (Dettmers et al. 2023) within 1 %.
    from bench.qlora_pieces import nf4_bytes

    measured, planned = nf4_bytes("mistral")
    assert measured > 0
    assert abs(planned / measured - 1) <= 0.01, (measured, planned)


def test_qlora_plans_are_refused_by_the_simulation_with_the_reason():
    from bench.memory_accuracy import Point, strategy
    from bench.qlora_pieces import QLORA
    from orchestrate.errors import UserError
    from orchestrate.simulate.verify import verify_plan

    plan = Point("llama", strategy("ddp", 0, 1, False), 512, QLORA).plan()
    with pytest.raises(UserError) as err:
        verify_plan(plan)
    assert "4-bit" in str(err.value.problems[0].message)
