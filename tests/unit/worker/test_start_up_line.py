"""The worker's start-up line names the run's training samples for what they are: a method's own records
as the method words them (`Method.record_noun`: preference pairs, KTO's labelled answers, GRPO's prompts),
else the token pipeline's blocks of seq_len (packed) or padded samples."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrate.planner.strategy import Strategy
from orchestrate.worker.callbacks.standard import Progress
from orchestrate.worker.stages import callbacks
from tests.helpers.plans import make_plan

DDP = Strategy("ddp", 0, "none", "none", "fp32", False, 2)
GRPO = {"num_generations": 2, "max_completion_length": 8, "rewards": [{"kind": "format", "pattern": "x"}]}


def _start_up_line(config: dict) -> str:
    plan = make_plan(DDP, config=config)
    data = SimpleNamespace(train=SimpleNamespace(shape=(12, 32)), validation=SimpleNamespace(shape=(3, 32)))
    (progress,) = [c for c in callbacks(plan, SimpleNamespace(world_size=2), data, 0, None) if isinstance(c, Progress)]
    return progress.intro[0]


@pytest.mark.parametrize(("config", "noun"), [
    ({}, "blocks"),  # plain text, packed into blocks of seq_len
    ({"data": {"packing": False}}, "samples"),  # one padded document or record per sample
    ({"preference": {"loss": "dpo"}}, "pairs"),
    ({"preference": {"loss": "kto"}}, "answers"),
    ({"grpo": GRPO}, "prompts"),
])
def test_the_start_up_line_names_the_training_samples(config, noun):
    assert _start_up_line(config).endswith(f"(12 train / 3 validation {noun})")
