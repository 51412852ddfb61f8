"""The step loop and its callbacks, in one process with a fake engine (no process group, no model):
the order the phases put the callbacks in, what each sees of the step (the record the loop made,
what earlier phases added, the checkpointed flag), that a STOP callback ends the loop, and that a
callback cannot replace what the loop recorded."""

from __future__ import annotations

import pytest
import torch

from orchestrate.backends.base import StepResult
from orchestrate.planner.strategy import Strategy
from orchestrate.run.layout import RunDir
from orchestrate.worker.callbacks.base import Callback, Phase, StepEnd, Training, in_order
from orchestrate.worker.loop import run_loop
from orchestrate.worker.signals import StopRequest
from tests.helpers.engines import cpu_rank
from tests.helpers.plans import make_plan
from tests.helpers.step_loop import CausalBatches, UnsavedCheckpointer

DDP = Strategy("ddp", 0, "none", "none", "fp32", False, 2)


class _Engine:
    def __init__(self) -> None:
        self.steps: list[int] = []  # micro-batches per step

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        self.steps.append(len(micro_batches))
        return StepResult(loss=1.0 / len(self.steps), grad_norm=0.5, lr=1e-3)


class _Recorder(Callback):
    def __init__(self, name: str, phase: Phase, log: list, act=None) -> None:
        self.name, self.phase, self.log, self.act = name, phase, log, act

    def on_train_start(self, training: Training) -> None:
        self.log.append(("start", self.name, training.start_step))

    def on_step_end(self, training: Training, end: StepEnd) -> None:
        self.log.append((end.step, self.name, dict(end.record), end.checkpointed))
        if self.act is not None:
            self.act(end)

    def on_train_end(self, training: Training, stopped_early: bool) -> None:
        self.log.append(("end", self.name, stopped_early))


def _training(max_steps: int, start_step: int = 0, tmp_path=None) -> tuple[Training, _Engine]:
    plan = make_plan(DDP, ranks=1, config={"train": {"max_steps": max_steps, "global_batch_size": 4}})
    engine = _Engine()
    return Training(plan, cpu_rank(), RunDir(tmp_path), engine, CausalBatches(), UnsavedCheckpointer(), StopRequest(), start_step), engine


def _callbacks(log: list, stop_at: int | None = None) -> list[Callback]:
    def checkpoint(end: StepEnd) -> None:
        end.checkpointed = True

    def stop(end: StepEnd) -> None:
        end.stop = end.step == stop_at

    # registered out of order on purpose: the phases order them
    return [_Recorder("stop", Phase.STOP, log, stop), _Recorder("observe-a", Phase.OBSERVE, log),
            _Recorder("persist", Phase.PERSIST, log, checkpoint),
            _Recorder("measure", Phase.MEASURE, log, lambda end: end.add({"eval_loss": 2.0 * end.step})),
            _Recorder("weights", Phase.WEIGHTS, log), _Recorder("observe-b", Phase.OBSERVE, log)]


def test_callbacks_run_in_phase_order_and_see_what_earlier_phases_did(tmp_path):
    training, engine = _training(3, tmp_path=tmp_path)
    log: list = []
    assert run_loop(training, _callbacks(log)) is False
    order = ["weights", "measure", "observe-a", "observe-b", "persist", "stop"]
    assert [e[1] for e in log if e[0] == "start"] == order and all(e[2] == 0 for e in log if e[0] == "start")
    assert [e[1] for e in log if e[0] == "end"] == order and not any(e[2] for e in log if e[0] == "end")
    steps = [e for e in log if isinstance(e[0], int)]
    assert [e[0] for e in steps] == [1] * 6 + [2] * 6 + [3] * 6
    assert [e[1] for e in steps[:6]] == order
    assert engine.steps == [2, 2, 2]  # global 4 / (micro 2 x 1 rank): two micro-batches a step
    for step, name, record, checkpointed in steps:
        assert record["step"] == step and record["loss"] == pytest.approx(1 / step)
        assert record["tokens"] == training.plan.tokens_per_step == 4 * 32
        # the evaluation's metric is there for everything after MEASURE, the checkpoint for STOP only
        assert ("eval_loss" in record) == (name not in ("weights", "measure"))
        assert checkpointed == (name == "stop")


def test_a_stop_callback_ends_the_loop_after_its_step_and_a_resumed_loop_starts_after_its_checkpoint(tmp_path):
    training, engine = _training(5, tmp_path=tmp_path)
    log: list = []
    assert run_loop(training, _callbacks(log, stop_at=2)) is True
    assert len(engine.steps) == 2 and all(e[2] for e in log if e[0] == "end")  # told it stopped early
    resumed, engine = _training(5, start_step=3, tmp_path=tmp_path)
    log = []
    run_loop(resumed, _callbacks(log))
    assert len(engine.steps) == 2 and [e[0] for e in log if isinstance(e[0], int)][::6] == [4, 5]
    assert all(e[2] == 3 for e in log if e[0] == "start")


def test_callbacks_add_to_the_record_but_never_replace_the_loop_s_entries():
    end = StepEnd(1, False, False, {"step": 1, "loss": 2.0})
    end.add({"eval_loss": 1.5})
    assert end.record == {"step": 1, "loss": 2.0, "eval_loss": 1.5}
    with pytest.raises(KeyError, match="loss"):
        end.add({"loss": 0.0})


def test_callbacks_of_one_phase_keep_their_registration_order():
    log: list = []
    a, b, c = (_Recorder(n, p, log) for n, p in (("a", Phase.OBSERVE), ("b", Phase.MEASURE), ("c", Phase.OBSERVE)))
    assert in_order([a, b, c]) == [b, a, c]
