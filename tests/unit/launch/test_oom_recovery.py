"""Recovering from an out-of-memory error: a rank that runs out of device memory records where and
how much (RUN_DIR/oom/rank-<N>.json) and exits EX_OUT_OF_MEMORY; the launcher re-plans with the
shortfall added as a measured correction and resumes from the newest checkpoint, at most
train.oom_retries times, and stops with the planner's refusal when nothing fits any more.

The end-to-end test runs 2 gloo ranks with an injected error (tests/helpers/oom_worker.py: a CPU has
no CUDA allocator to exhaust); the rest is tested on synthetic records without processes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from orchestrate.api import plan_for
from orchestrate.config.load import config_from_dict
from orchestrate.hardware.flags import HardwareFlags
from orchestrate.hardware.profile import MemoryCorrection
from orchestrate.launch.oom_replan import OutOfMemory, recover
from orchestrate.launch.rundir import prepare_run
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import read_oom_records, write_oom_record
from tests.helpers.plans import TINY_GPT2

GIB = 2**30
RATIO = 3.0
"""The injected shortfall: the failing step needed 3x the prediction."""


def _config(tmp_path: Path, **train):
    return config_from_dict({
        "model": {"architecture": dict(TINY_GPT2)},
        "train": {"seq_len": 32, "global_batch_size": 8, "max_steps": 4, "checkpoint_every": 2, "seed": 0,
                  "output_dir": str(tmp_path / "runs"), **train},
        "data": {"generate_demo_corpus": True},
    }, tmp_path)


def _tight_hardware(config):
    """2 CPU ranks with host RAM between what the first plan needs and what it needs x RATIO, so the
    correction rules it out but a plan with activation checkpointing still fits."""
    roomy = HardwareFlags(gpus=2).resolve()
    first = plan_for(config, roomy)
    per_rank = first.chosen.memory.gpu_total
    host = first.chosen.memory.cpu_total + 2 * per_rank * (1 + RATIO) / 2
    return roomy.model_copy(update={"cpu_memory_bytes": int(host / config.strategy.cpu_memory_headroom)}), first


def _corrected(hardware, ratio=RATIO):
    return hardware.model_copy(update={"memory_corrections": [MemoryCorrection(ratio=ratio, source="test")]})


def _record(plan: RunPlan, rank: int, needed: int, step: int = 3) -> dict:
    return {"rank": rank, "node": 0, "step": step, "phase": "backward", "device": "cpu",
            "max_allocated_bytes": 0, "max_reserved_bytes": 0, "reserved_bytes": 0, "requested_bytes": needed,
            "needed_at_least_bytes": needed, "predicted_bytes": plan.chosen.memory.gpu_total,
            "strategy": plan.chosen.name, "message": "synthetic", "time": 0.0}


def test_the_tight_hardware_has_a_plan_after_the_correction_and_it_differs(tmp_path):
    """The premise of the end-to-end test, checked by the planner alone."""
    config = _config(tmp_path)
    hardware, first = _tight_hardware(config)
    before = plan_for(config, hardware)
    after = plan_for(config, _corrected(hardware))
    assert isinstance(before, RunPlan) and before.chosen.name == first.chosen.name
    assert isinstance(after, RunPlan) and after.chosen.name != before.chosen.name
    assert after.chosen.memory.gpu["measured_correction"] > 0
    assert "measured_correction" not in before.chosen.memory.gpu


def test_a_correction_only_raises_the_prediction_and_only_for_its_family(tmp_path):
    config = _config(tmp_path, micro_batch_size=2)
    hardware = HardwareFlags(gpus=2).resolve()
    plain = plan_for(config, hardware)
    family = plain.strategy.family
    same = plan_for(config, hardware.model_copy(update={"memory_corrections": [
        MemoryCorrection(ratio=1.5, family=family, source="test")]}))
    other = plan_for(config, hardware.model_copy(update={"memory_corrections": [
        MemoryCorrection(ratio=1.5, family="no-such-family", source="test")]}))
    assert same.chosen.memory.gpu_total == pytest.approx(1.5 * plain.chosen.memory.gpu_total, rel=1e-6)
    assert other.chosen.memory.gpu_total == plain.chosen.memory.gpu_total
    with pytest.raises(ValueError):
        MemoryCorrection(ratio=0.9, source="test")  # never lower than the analytical model


def _written_run(tmp_path: Path, config, hardware) -> tuple[RunPlan, Path]:
    run_dir = tmp_path / "run"
    plan = prepare_run(plan_for(config, hardware), run_dir)
    return plan, run_dir


def test_recover_replans_with_the_worst_rank_s_shortfall(tmp_path):
    config = _config(tmp_path)
    hardware, _ = _tight_hardware(config)
    plan, run_dir = _written_run(tmp_path, config, hardware)
    predicted = plan.chosen.memory.gpu_total
    write_oom_record(run_dir, 0, _record(plan, 0, int(1.5 * predicted)))
    write_oom_record(run_dir, 1, _record(plan, 1, int(RATIO * predicted)))
    said: list[str] = []
    new = recover(plan, run_dir, 0, said.append)
    assert new is not None and new.chosen.name != plan.chosen.name
    assert new.hardware.memory_corrections[-1].ratio == pytest.approx(RATIO, rel=1e-6)
    assert "rank 1 ran out of memory at step 3 (backward)" in said[0]
    assert said[1].startswith("re-plan 1 of 2: x3.00") and new.chosen.name in said[1]
    assert "resuming from step 0 (no checkpoint yet)" in said[1]
    written = RunPlan.read(run_dir / "plan.json")  # the workers' plan carries the correction
    assert written.chosen.name == new.chosen.name and written.hardware.memory_corrections


def test_recover_stops_at_the_retry_limit_and_when_turned_off(tmp_path):
    for retries, attempt, why in ((2, 2, "2 re-plan(s) used"), (0, 0, "train.oom_retries is 0")):
        config = _config(tmp_path / str(retries), oom_retries=retries)
        plan, run_dir = _written_run(tmp_path / str(retries), config, HardwareFlags(gpus=2).resolve())
        write_oom_record(run_dir, 0, _record(plan, 0, 2 * plan.chosen.memory.gpu_total))
        said: list[str] = []
        assert recover(plan, run_dir, attempt, said.append) is None
        assert why in said[-1]


def test_recover_stops_with_the_planner_s_refusal_when_nothing_fits(tmp_path):
    config = _config(tmp_path)
    hardware, _ = _tight_hardware(config)
    plan, run_dir = _written_run(tmp_path, config, hardware)
    write_oom_record(run_dir, 0, _record(plan, 0, 1000 * plan.chosen.memory.gpu_total))
    said: list[str] = []
    assert recover(plan, run_dir, 0, said.append) is None
    assert said[-1].startswith("no plan fits with the measured x1000.00 correction")
    assert "fix:" in said[-1]  # the refusal's remedies
    assert RunPlan.read(run_dir / "plan.json").chosen.name == plan.chosen.name  # nothing rewritten


def test_a_host_oom_is_told_as_host_memory_with_what_would_help_and_is_not_replanned(tmp_path):
    config = _config(tmp_path)
    plan, run_dir = _written_run(tmp_path, config, HardwareFlags(gpus=2).resolve())
    host = {**_record(plan, 1, 7 * GIB), "memory": "host", "message": "DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 7516192768 bytes. Error code 12 (Cannot allocate memory)"}
    write_oom_record(run_dir, 0, _record(plan, 0, 2 * plan.chosen.memory.gpu_total))  # a device record beside it
    write_oom_record(run_dir, 1, host)
    said: list[str] = []
    assert recover(plan, run_dir, 0, said.append) is None
    (told,) = said
    assert told.startswith("rank 1 (node 0) ran out of host memory (RAM) at step 3 (backward); it asked for 7.00 GiB")
    assert "smaller train.micro_batch_size" in told and "strategy.offload: none" in told
    assert "train.oom_retries re-plans device out-of-memory errors only" in told
    assert RunPlan.read(run_dir / "plan.json").chosen.name == plan.chosen.name  # nothing re-planned


def test_no_record_means_no_recovery(tmp_path):
    config = _config(tmp_path)
    plan, run_dir = _written_run(tmp_path, config, HardwareFlags(gpus=2).resolve())
    assert recover(plan, run_dir, 0, lambda text: pytest.fail(text)) is None
    assert OutOfMemory([_record(plan, 0, 10)]).correction().ratio == 1.0  # never below 1


@pytest.mark.slow
def test_an_injected_oom_at_step_3_is_replanned_and_resumed_from_step_2(tmp_path, monkeypatch):
    from orchestrate.api import launch, launch_request
    from orchestrate.launch.torchrun_args import LaunchOptions
    from orchestrate.transports.local.transport import LocalTorchrun

    config = _config(tmp_path)
    hardware, first = _tight_hardware(config)
    monkeypatch.setenv("ORCHESTRATE_TEST_INJECT_OOM_AT_STEP", "3")
    monkeypatch.setenv("ORCHESTRATE_TEST_INJECT_OOM_REQUEST", str(int(RATIO * first.chosen.memory.gpu_total)))
    transport = LocalTorchrun(LaunchOptions(worker_module="tests.helpers.oom_worker"))
    result = launch(launch_request(config, hardware, run_dir=tmp_path / "run"), transport)
    text = "\n".join(result.messages)
    assert result.exit_code == 0, text
    assert "ran out of memory at step 3 (backward): it needed at least" in text
    assert "ran out of device memory (exit 71; its record:" in text
    assert "re-plan 1 of 2: x3.00" in text and "resuming from the checkpoint of step 2" in text
    assert result.plan.chosen.name != first.chosen.name
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["predicted_gpu_bytes_per_rank"] == result.plan.chosen.memory.gpu_total
    assert (result.run_dir / "model" / "model.safetensors").is_file()
    assert read_oom_records(result.run_dir) == []  # cleared by the successful start


@pytest.mark.slow
def test_a_worker_out_of_host_memory_ends_the_launch_with_one_message_naming_it(tmp_path, monkeypatch):
    """2 gloo ranks, each rank's backward of step 3 raising what torch's CPU allocator raises when the host
    is out of memory: exit 71 with a few lines naming host memory, the rank and what would help, no
    traceback, no re-plan."""
    from orchestrate.api import launch, launch_request
    from orchestrate.launch.torchrun_args import LaunchOptions
    from orchestrate.run.exits import EX_OUT_OF_MEMORY
    from orchestrate.transports.local.transport import LocalTorchrun

    config = _config(tmp_path)
    monkeypatch.setenv("ORCHESTRATE_TEST_INJECT_OOM_AT_STEP", "3")
    monkeypatch.setenv("ORCHESTRATE_TEST_INJECT_OOM_REQUEST", str(7 * GIB))
    monkeypatch.setenv("ORCHESTRATE_TEST_INJECT_OOM_MEMORY", "host")
    transport = LocalTorchrun(LaunchOptions(worker_module="tests.helpers.oom_worker"))
    result = launch(launch_request(config, HardwareFlags(gpus=2).resolve(), run_dir=tmp_path / "run"), transport)
    text = "\n".join(result.messages)
    assert result.exit_code == EX_OUT_OF_MEMORY, text
    # Every rank raises at step 3: torchrun reports whichever ended first, the message the record it finds.
    assert re.search(r"worker rank [01] ran out of host memory \(exit 71", text), text
    assert re.search(r"rank [01] \(node 0\) ran out of host memory \(RAM\) at step 3 \(backward\); it asked for "
                     r"7\.00 GiB", text), text
    assert "re-plan" not in text.replace("re-plans device", "") and "Traceback" not in text
    log = "".join(p.read_text() for p in (result.run_dir / "logs").rglob("*.log"))
    assert "rank 0: out of host memory at step 3 (backward)" in log and "Traceback" not in log


class _AlwaysOutOfMemory:
    """A transport whose workers run out of memory at step 3 on every start (no processes)."""

    remote_workers = False

    def __init__(self, ratio: float) -> None:
        self.ratio, self.plans = ratio, []

    def prepare(self, plan, run_dir, env, max_restarts, dry_run):
        from orchestrate.launch.session import Prepared

        return Prepared(command="true", script="true", script_comment="test")

    def run(self, plan, run_dir, say, console) -> int:
        self.plans.append(plan.chosen.name)
        write_oom_record(run_dir, 0, _record(plan, 0, int(self.ratio * plan.chosen.memory.gpu_total)))
        return 1  # as torchrun reports any failed worker


def test_the_launcher_stops_after_train_oom_retries_with_exit_71(tmp_path):
    from orchestrate.launch.session import start
    from orchestrate.run.exits import EX_OUT_OF_MEMORY

    config = _config(tmp_path, oom_retries=2)
    plan, run_dir = _written_run(tmp_path, config, HardwareFlags(gpus=2).resolve())
    transport = _AlwaysOutOfMemory(1.1)
    result = start(plan, run_dir, transport, own_data=True)
    assert result.exit_code == EX_OUT_OF_MEMORY
    assert len(transport.plans) == 3  # the first start and two re-plans
    text = "\n".join(result.messages)
    assert text.count("re-plan ") == 2 and "not re-planning: 2 re-plan(s) used" in text
    assert len(result.plan.hardware.memory_corrections) == 2
    assert result.plan.hardware.memory_correction(result.plan.strategy.family) == pytest.approx(1.1**2, rel=1e-3)
