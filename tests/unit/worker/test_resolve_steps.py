"""A worker turns `train.num_epochs` into optimizer steps over its data (`stages.resolve_steps`): the
sampler's training samples decide them, a run of max_steps is left alone, the resolved plan still
writes the length as given (a checkpoint's plan copy), and a checkpoint past the resolved steps is
refused naming train.num_epochs (before the count is known, the launcher's check lets it pass); epochs
that would make more steps than a count may hold are one error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrate.config.section import MAX_COUNT
from orchestrate.errors import UserError
from orchestrate.planner.strategy import Strategy
from orchestrate.run.checkpoints import CheckpointMeta
from orchestrate.run.resume_rules import resume_problems
from orchestrate.worker.stages import resolve_steps
from tests.helpers.plans import make_plan

DDP = Strategy("ddp", 0, "none", "none", "fp32", False, 2)


def _data(samples: int) -> SimpleNamespace:
    return SimpleNamespace(sampler=SimpleNamespace(num_blocks=samples))


def _meta(plan, step: int) -> CheckpointMeta:
    return CheckpointMeta.of(plan, step, 2, {}, "test")


def test_epochs_become_the_steps_of_the_samples_and_steps_stay():
    plan = make_plan(DDP, config={"train": {"max_steps": None, "num_epochs": 2.5, "global_batch_size": 8}})
    resolved = resolve_steps(plan, _data(100), None)
    assert resolved.config.train.max_steps == 33  # ceil(2.5 x ceil(100 / 8))
    assert (plan.config.train.max_steps, resolved.config.train.num_epochs) == (None, 2.5)
    assert resolved.to_dict()["config"] == plan.to_dict()["config"]  # what a checkpoint's plan copy holds
    steps = make_plan(DDP, config={"train": {"max_steps": 7}})
    assert resolve_steps(steps, _data(100), None) is steps


def test_a_checkpoint_past_the_epochs_is_refused_once_they_are_steps():
    plan = make_plan(DDP, config={"train": {"max_steps": None, "num_epochs": 1, "global_batch_size": 8}})
    late = _meta(plan, 20)
    assert resume_problems(late, plan) == []  # the launcher cannot count the steps yet
    (problem,) = resume_problems(late, resolve_steps(plan, _data(80), None))
    assert problem.where == "train.num_epochs"
    assert problem.message == "1 epoch = 10 steps end before the checkpoint's step 20"
    assert resume_problems(_meta(plan, 10), resolve_steps(plan, _data(80), None)) == []


def test_more_steps_than_a_count_holds_is_one_error():
    plan = make_plan(DDP, config={"train": {"max_steps": None, "num_epochs": float(MAX_COUNT), "global_batch_size": 8}})
    with pytest.raises(UserError) as refused:
        resolve_steps(plan, _data(100), None)
    (problem,) = refused.value.problems
    assert problem.where == "train.num_epochs" and problem.fix == "lower train.num_epochs"
