"""The CUDA allocator setting a GPU launch runs with: orchestrate sets expandable segments unless the
user set PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF, the hardware profile records which (so the plan's
allocator reserve models it), and plan.json's run section hands it to the workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrate.hardware.alloc_conf import expandable_segments_in, launch_alloc_env
from orchestrate.hardware.resolve import resolve_hardware
from orchestrate.planner.allocator_reserve import reserve_bytes, state_bytes
from orchestrate.planner.memory import estimate_memory
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import PLAN_FILE
from tests.unit.launch.test_launch import _dry_run
from tests.unit.planner.test_memory_model import strat

GPU = {"profile": "generic-8gb", "gpus": 2}


@pytest.mark.parametrize(("environ", "expandable"), [
    ({}, True),  # what orchestrate will set
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, False),  # torch's default is off
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}, True),
    # torch 2.13 reads PYTORCH_ALLOC_CONF first
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, True),
])
def test_the_profile_records_the_setting_the_environment_will_run(environ, expandable):
    hw = resolve_hardware(**GPU, environ=environ)
    assert hw.expandable_segments is expandable and hw.name == "generic-8gb+flags"


def test_the_os_environment_is_read_when_none_is_given(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert not resolve_hardware(**GPU).expandable_segments
    assert resolve_hardware(profile="generic-8gb").name == "generic-8gb"  # no flags: the preset's name


def test_the_conf_string_is_read_as_torch_parses_it():
    assert expandable_segments_in("garbage_collection_threshold:0.6, expandable_segments:True")
    assert not expandable_segments_in("expandable_segments:True,expandable_segments:False")  # the last wins


def test_the_plan_reserve_follows_the_setting():
    from orchestrate.model.formulas import shape_from_dict
    from tests.methods.lora.test_lora_plan import LLAMA3_8B

    shape, s = shape_from_dict(dict(LLAMA3_8B)), strat("fsdp", 3, ac=True)
    reserves = {}
    for on in (False, True):
        hw = resolve_hardware(**GPU, environ={"PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:{on}"})
        gpu = estimate_memory(shape, hw, s, 2048).gpu
        accounted = sum(v for key, v in gpu.items() if key not in ("cuda_context", "allocator_reserve"))
        reserves[on] = gpu["allocator_reserve"]
        assert reserves[on] == pytest.approx(reserve_bytes("fsdp", on, accounted, state_bytes(gpu)), abs=1)
    assert reserves[False] > reserves[True]  # expandable segments fragment less


def test_without_expandable_segments_the_reserve_follows_the_transient_bytes():
    """A longer sequence adds activations and logits, freed every step, which the replayed allocator
    fragments: the reserve grows by the transient fraction of them; the states stay charged their own
    small fraction (planner/allocator_reserve.py)."""
    from orchestrate.model.formulas import shape_from_dict
    from orchestrate.planner.allocator_reserve import RESERVE
    from tests.methods.lora.test_lora_plan import LLAMA3_8B

    shape, s = shape_from_dict(dict(LLAMA3_8B)), strat("fsdp", 3, ac=True)
    hw = resolve_hardware(**GPU, environ={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    # accumulating: the gradients persist instead of filling blocks the activations free
    short, long = (estimate_memory(shape, hw, s, seq, 2).gpu for seq in (512, 2048))
    assert state_bytes(short) == state_bytes(long)
    grown = sum(long.values()) - sum(short.values()) - (long["allocator_reserve"] - short["allocator_reserve"])
    _, of_states, of_transient = RESERVE["fsdp"][False]
    assert of_transient > 10 * of_states
    assert long["allocator_reserve"] - short["allocator_reserve"] == pytest.approx(of_transient * grown, rel=1e-6)


def test_a_gpu_launch_gives_the_workers_orchestrates_setting_or_the_users(tmp_path: Path, monkeypatch):
    hw = resolve_hardware(**GPU, environ={})
    result = _dry_run(tmp_path / "own", hardware=hw)
    plan = RunPlan.read(result.run_dir / PLAN_FILE)
    assert plan.run.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in result.command
    assert any(m.startswith("CUDA allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True") for m in result.messages)

    # Set by the user: their variable and value travel to the workers (SSH ones included)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False,max_split_size_mb:256")
    env, why = launch_alloc_env(True, {"PYTORCH_ALLOC_CONF": "expandable_segments:False,max_split_size_mb:256"})
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:False,max_split_size_mb:256"} and "your environment" in why
    user_hw = resolve_hardware(**GPU)
    assert not user_hw.expandable_segments
    plan = RunPlan.read(_dry_run(tmp_path / "user", hardware=user_hw).run_dir / PLAN_FILE)
    assert plan.run.env.get("PYTORCH_ALLOC_CONF") == "expandable_segments:False,max_split_size_mb:256"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in plan.run.env


def test_cpu_launches_set_no_allocator_variable(tmp_path: Path):
    plan = RunPlan.read(_dry_run(tmp_path).run_dir / PLAN_FILE)
    assert not any("ALLOC_CONF" in key for key in plan.run.env)
