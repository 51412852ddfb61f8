"""A worker's out-of-memory record: the step loop turns torch.OutOfMemoryError (and the host's: torch's
CPU allocator's RuntimeError, MemoryError) into the step and the engine's phase, the record holds
which memory ran out, the measured need and the plan's prediction, and PyTorch's "Tried to allocate"
sizes are read as the allocator writes them (one process, a fake engine); on a GPU the need adds
what lies outside the allocator as planned (torch's statistics stubbed)."""

from __future__ import annotations

import json

import pytest
import torch

from orchestrate.backends.base import StepResult
from orchestrate.planner.strategy import Strategy
from orchestrate.run.layout import RunDir, clear_oom_records, read_oom_records
from orchestrate.worker.callbacks.base import Training
from orchestrate.worker.loop import run_loop
from orchestrate.worker.oom import (
    StepOutOfMemory,
    host_out_of_memory,
    oom_record,
    record_oom,
    requested_bytes,
)
from orchestrate.worker.signals import StopRequest
from tests.helpers.engines import cpu_rank
from tests.helpers.plans import make_plan
from tests.helpers.step_loop import CausalBatches, UnsavedCheckpointer

DDP = Strategy("ddp", 0, "none", "none", "fp32", False, 2)


class _FailingEngine:
    """Runs steps until `fail_at`, whose `phase` part raises as CUDA's allocator would."""

    def __init__(self, fail_at: int, phase: str, error: BaseException | None = None) -> None:
        self.fail_at, self.fail_phase, self.phase, self.steps = fail_at, phase, "forward", 0
        self.error = error or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has ...")

    def train_step(self, micro_batches) -> StepResult:
        self.steps += 1
        for self.phase in ("forward", "backward", "optimizer"):
            if self.steps == self.fail_at and self.phase == self.fail_phase:
                raise self.error
        return StepResult(loss=1.0, grad_norm=0.5, lr=1e-3)


@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer"])
def test_the_loop_reports_the_step_and_phase_of_an_oom(tmp_path, phase):
    plan = make_plan(DDP, ranks=1, config={"train": {"max_steps": 5, "global_batch_size": 4}})
    engine = _FailingEngine(3, phase)
    training = Training(plan, cpu_rank(), RunDir(tmp_path), engine, CausalBatches(), UnsavedCheckpointer(), StopRequest(), 0)
    with pytest.raises(StepOutOfMemory) as caught:
        run_loop(training, [])
    assert (caught.value.step, caught.value.phase) == (3, phase)
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)


HOST_OOM = ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 7516192768 bytes. Error code 12 "
            "(Cannot allocate memory)")
"""torch's CPU allocator when posix_memalign fails (c10/core/impl/alloc_cpu.cpp)."""


@pytest.mark.parametrize(("error", "host"), [
    (RuntimeError(HOST_OOM), True),
    (RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 64 bytes."), True),
    (MemoryError(), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB."), False),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
])
def test_host_out_of_memory_is_told_by_the_cpu_allocator_s_message_or_memory_error(error, host):
    assert host_out_of_memory(error) is host


@pytest.mark.parametrize("error", [RuntimeError(HOST_OOM), MemoryError()])
def test_the_loop_reports_a_host_oom_as_host_memory_and_the_record_says_so(tmp_path, error):
    plan = make_plan(DDP, ranks=1, config={"train": {"max_steps": 5, "global_batch_size": 4}})
    training = Training(plan, cpu_rank(), RunDir(tmp_path), _FailingEngine(2, "backward", error), CausalBatches(),
                        UnsavedCheckpointer(), StopRequest(), 0)
    with pytest.raises(StepOutOfMemory) as caught:
        run_loop(training, [])
    assert (caught.value.step, caught.value.phase, caught.value.memory) == (2, "backward", "host")
    record = oom_record(plan, cpu_rank(), 2, "backward", caught.value.__cause__, "host")
    assert record["memory"] == "host" and record["message"] == (str(error) or "MemoryError")
    assert record["requested_bytes"] == (7516192768 if str(error) else 0)


def test_an_error_that_is_no_oom_leaves_the_loop_as_it_is(tmp_path):
    plan = make_plan(DDP, ranks=1, config={"train": {"max_steps": 5, "global_batch_size": 4}})
    engine = _FailingEngine(2, "forward", RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    training = Training(plan, cpu_rank(), RunDir(tmp_path), engine, CausalBatches(), UnsavedCheckpointer(), StopRequest(), 0)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        run_loop(training, [])


@pytest.mark.parametrize(("message", "size"), [
    ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 7.79 GiB", 20 * 2**20),
    ("Tried to allocate 2.50 GiB", int(2.5 * 2**30)),
    ("Tried to allocate 512 bytes", 512),
    ("Tried to allocate 1.50 KiB", 1536),
    ("out of memory", 0),
])
def test_the_failed_request_is_read_from_pytorch_s_message(message, size):
    assert requested_bytes(message) == size


def test_the_record_on_cpu_holds_the_request_as_the_need_and_the_prediction(tmp_path):
    plan = make_plan(DDP, ranks=1, config={"train": {"max_steps": 5, "global_batch_size": 4}})
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")
    record = oom_record(plan, cpu_rank(), 3, "backward", error)
    assert record["needed_at_least_bytes"] == 20 * 2**20 == record["requested_bytes"]
    assert record["predicted_bytes"] == plan.chosen.memory.gpu_total and record["strategy"] == plan.chosen.name
    assert (record["step"], record["phase"], record["device"], record["rank"]) == (3, "backward", "cpu", 0)

    record_oom(plan, cpu_rank(), tmp_path, 3, "backward", error)
    assert json.loads((tmp_path / "oom" / "rank-0.json").read_text())["step"] == 3
    assert [r["phase"] for r in read_oom_records(tmp_path)] == ["backward"]
    clear_oom_records(tmp_path)
    assert read_oom_records(tmp_path) == []


def test_the_record_on_a_gpu_adds_the_context_and_nccl_to_the_allocator_s_need(monkeypatch):
    from orchestrate.backends.rank import Rank
    from orchestrate.config.load import config_from_dict
    from orchestrate.hardware.presets import load_preset
    from orchestrate.planning import plan_for
    from tests.helpers.plans import TINY_GPT2

    config = config_from_dict({"model": {"architecture": dict(TINY_GPT2)}, "train": {"seq_len": 64, "global_batch_size": 8}})
    plan = plan_for(config, load_preset("rtx3070").model_copy(update={"gpus_per_node": 2}))
    gpu = plan.chosen.memory.gpu
    assert gpu["nccl_buffers"] > 0 and gpu["cuda_context"] > 0
    stats = {"max_memory_allocated": 3 * 2**30, "max_memory_reserved": 5 * 2**30, "memory_reserved": 4 * 2**30}
    for name, value in stats.items():
        monkeypatch.setattr(torch.cuda, name, lambda device=None, value=value: value)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    rank = Rank(rank=1, local_rank=1, world_size=2, node=0, device=torch.device("cuda:1"))
    record = oom_record(plan, rank, 3, "forward", error)
    # reserved now + the request (6 GiB) is above the reserved peak (5 GiB)
    assert record["needed_at_least_bytes"] == 6 * 2**30 + gpu["cuda_context"] + gpu["nccl_buffers"]
    assert (record["device"], record["max_allocated_bytes"], record["max_reserved_bytes"]) == ("cuda", 3 * 2**30, 5 * 2**30)
