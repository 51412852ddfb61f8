"""The per-machine calibration file: where it lives, that it is written whole and never through a
link, that a run's memory verdict (here a synthetic one) raises the next plan's prediction for the
same family on the same machine, never lowers it, and is ignored for another machine, another
family, a preset, and with --no-calibration; that a verdict is measured from the allocated peak (a
reserved peak with room is cache, not need); a GPU worker gives back what start-up cached before it
measures."""

from __future__ import annotations

import pytest
import torch

from orchestrate.backends.rank import Rank
from orchestrate.config.load import config_from_dict
from orchestrate.hardware import calibration as cal
from orchestrate.hardware.presets import load_preset
from orchestrate.hardware.resolve import resolve_hardware
from orchestrate.hardware.software import SoftwareStack
from orchestrate.launch.calibration_record import (
    analytical_bytes,
    measured_need,
    record_verdict,
    verdict_ratio,
)
from orchestrate.planning import plan_for
from orchestrate.worker import stages
from tests.helpers.plans import TINY_GPT2


def _detected(driver: str = "550.54.14", torch: str = "2.5.1+cu124"):
    """An RTX 3070 profile as detection would give it on a machine with that driver and torch."""
    return load_preset("rtx3070").model_copy(update={
        "name": "detected:rtx3070", "gpus_per_node": 2, "driver_version": driver,
        "software": SoftwareStack(torch=torch, cuda="12.4")})


def _config(tmp_path):
    return config_from_dict({"model": {"architecture": dict(TINY_GPT2)},
                             "train": {"seq_len": 64, "global_batch_size": 8, "micro_batch_size": 2,
                                       "output_dir": str(tmp_path)},
                             "strategy": {"backend": "fsdp", "zero_stage": 3}}, tmp_path)


def _allocated_for(plan, ratio: float) -> int:
    """The allocated peak whose measured need is `ratio` x the analytical prediction (bisected: the
    reserve grows with the bytes allocated)."""
    low, high = 0, 4 * analytical_bytes(plan)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if measured_need(mid, plan) < ratio * analytical_bytes(plan) else (low, mid)
    return high


def _synthetic_run(tmp_path, plan, ratio: float, reserved_ratio: float = 1.0):
    """A run directory whose metrics say the allocated peak was the one of a `ratio` x need, and the
    reserved peak (on a card with room) `reserved_ratio` x the planned allocator part."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    allocated = _allocated_for(plan, ratio)
    reserved = int(reserved_ratio * plan.chosen.memory.gpu_allocator)
    lines = [f'{{"step": {s}, "gpu_max_allocated_bytes": {allocated - 1000 * (2 - s)}, '
             f'"gpu_max_reserved_bytes": {reserved}}}' for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_the_file_lives_in_the_xdg_cache_else_home_cache(tmp_path):
    assert cal.calibration_path({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "orchestrate/calibration.json"
    assert cal.calibration_path({"HOME": "/home/u"}).as_posix() == "/home/u/.cache/orchestrate/calibration.json"


def test_a_verdict_raises_the_next_plan_on_this_machine_and_the_plan_says_from_where(tmp_path):
    path = tmp_path / "cache/orchestrate/calibration.json"
    config, hw = _config(tmp_path), _detected()
    plan = plan_for(config, hw)
    said = record_verdict(plan, _synthetic_run(tmp_path, plan, 1.25), path)
    assert said and "1.25 for fsdp-z3" in said and str(path) in said
    stored = cal.read_calibration(path)
    assert [e.family for e in stored.entries] == ["fsdp-z3"] and stored.entries[0].ratios == [1.25]
    assert not list(path.parent.glob("*.tmp"))  # written whole

    again = plan_for(config, resolve_hardware(detect=_detected, software=SoftwareStack, calibration=path))
    assert again.chosen.memory.gpu_total == pytest.approx(1.25 * plan.chosen.memory.gpu_total, rel=1e-6)
    note = [n for n in again.notes if n.startswith("memory: measured correction x1.25")]
    assert note and str(path) in note[0] and "fsdp-z3" in note[0]


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_measured_need_of_the_planned_tensors_is_the_plan(tmp_path, gpus):
    # calibration_record.py rebuilds the allocator reserve and what lies outside the allocator as memory.py
    # plans them (two ranks: NCCL's buffers too), so the plan's own tensors give back the plan.
    plan = plan_for(_config(tmp_path), _detected().model_copy(update={"gpus_per_node": gpus}))
    memory = plan.chosen.memory
    assert (memory.gpu["nccl_buffers"] > 0) == (gpus == 2)
    assert measured_need(memory.gpu_tensors, plan) == pytest.approx(analytical_bytes(plan), abs=16)
    assert measured_need(memory.gpu_tensors + 2**30, plan) > analytical_bytes(plan) + 2**30  # reserve grows too


def test_a_reserved_peak_with_room_is_not_taken_for_the_need(tmp_path):
    # On a card with room the allocator keeps its cache: a reserved peak 1.5x the plan's allocator part
    # with the tensors as planned records 1.00, and the next plan is not raised.
    path = tmp_path / "calibration.json"
    config = _config(tmp_path)
    plan = plan_for(config, _detected())
    said = record_verdict(plan, _synthetic_run(tmp_path, plan, 1.0, reserved_ratio=1.5), path)
    assert "1.00 for fsdp-z3" in said
    again = plan_for(config, resolve_hardware(detect=_detected, software=SoftwareStack, calibration=path))
    assert again.chosen.memory.gpu_total == plan.chosen.memory.gpu_total


@pytest.mark.parametrize("other", [
    lambda: _detected(driver="535.1"),           # another driver: another machine as far as memory goes
    lambda: _detected(torch="2.4.0+cu121"),      # another torch
    lambda: load_preset("rtx3070").model_copy(update={"gpus_per_node": 2}),  # a preset: not measured here
])
def test_an_entry_is_ignored_on_another_machine(tmp_path, other):
    path = tmp_path / "calibration.json"
    config = _config(tmp_path)
    plan = plan_for(config, _detected())
    record_verdict(plan, _synthetic_run(tmp_path, plan, 1.3), path)
    hw = other()
    assert cal.with_calibration(hw, path) == hw
    assert plan_for(config, cal.with_calibration(hw, path)).chosen.memory.gpu_total == plan_for(config, hw).chosen.memory.gpu_total


def test_an_entry_of_another_family_and_no_calibration_are_ignored(tmp_path):
    path = tmp_path / "calibration.json"
    key = cal.machine_key(_detected())
    cal.write_calibration(path, cal.add_measurement(cal.CalibrationFile(), key, "deepspeed-z2", 1.4, "test"))
    config = _config(tmp_path)  # pinned to fsdp-z3
    calibrated = resolve_hardware(detect=_detected, software=SoftwareStack, calibration=path)
    assert [c.family for c in calibrated.memory_corrections] == ["deepspeed-z2"]
    assert plan_for(config, calibrated).chosen.memory.gpu_total == plan_for(config, _detected()).chosen.memory.gpu_total
    assert resolve_hardware(detect=_detected, software=SoftwareStack, calibration=None).memory_corrections == []


def test_a_ratio_below_one_never_lowers_the_prediction_and_the_largest_recent_one_applies(tmp_path):
    key = cal.machine_key(_detected())
    data = cal.CalibrationFile()
    data = cal.add_measurement(data, key, "fsdp-z3", 0.8, "a lucky run")
    assert cal.corrections(_detected(), data, tmp_path) == []
    data = cal.add_measurement(data, key, "fsdp-z3", 1.5, "an outlier")
    for i in range(cal.KEPT_RATIOS - 1):
        data = cal.add_measurement(data, key, "fsdp-z3", 1.1, f"run {i}")
    assert cal.corrections(_detected(), data, tmp_path)[0].ratio == 1.5
    data = cal.add_measurement(data, key, "fsdp-z3", 1.1, "one more")  # the outlier ages out
    assert cal.corrections(_detected(), data, tmp_path)[0].ratio == 1.1
    assert len(data.entries[0].ratios) == cal.KEPT_RATIOS


def test_a_cpu_run_records_nothing_and_a_damaged_file_counts_as_empty(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text("{not json")
    assert cal.read_calibration(path).entries == []
    assert verdict_ratio([{"step": 1, "rss_peak_bytes_max_rank": 10**9}], plan_for(_config(tmp_path), _detected())) is None


def test_the_file_is_never_written_through_a_link(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text("users' file\n")
    link = tmp_path / "calibration.json"
    link.symlink_to(target)
    config = _config(tmp_path)
    plan = plan_for(config, _detected())
    said = record_verdict(plan, _synthetic_run(tmp_path, plan, 1.2), link)
    assert said.startswith("calibration not recorded") and "symbolic link" in said
    assert target.read_text() == "users' file\n"


def test_a_gpu_oom_is_recorded_against_the_analytical_prediction_a_cpu_one_is_not(tmp_path):
    from orchestrate.launch.calibration_record import record_oom_ratio

    path = tmp_path / "calibration.json"
    plan = plan_for(_config(tmp_path), _detected())
    worst = {"device": "cuda", "step": 3, "needed_at_least_bytes": int(1.4 * analytical_bytes(plan))}
    assert record_oom_ratio(plan, {**worst, "device": "cpu"}, path) is None and not path.exists()
    assert "1.40 for fsdp-z3" in record_oom_ratio(plan, worst, path)
    assert cal.read_calibration(path).entries[0].sources == ["out-of-memory at step 3"]


@pytest.mark.parametrize("device", ["cuda:0", "cpu"])
def test_a_gpu_worker_gives_back_the_start_up_cache_before_its_first_step(device, monkeypatch):
    """What loading cached would otherwise sit under the reserved peak a calibration is made from;
    the peak statistics stay (a start-up peak above training's is still one the card held)."""
    calls = []
    monkeypatch.setattr(stages.gc, "collect", lambda: calls.append("gc"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append("reset"))
    stages.release_start_up_cache(Rank(rank=0, local_rank=0, world_size=1, node=0, device=torch.device(device)))
    assert calls == (["gc", "empty_cache"] if device.startswith("cuda") else [])
