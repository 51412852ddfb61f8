"""Full fine-tuning (`train.method: full`, the default): every weight of a Hugging Face model trains.
The base method the others are measured against: the memory and speed models' own terms describe it
(planner/memory.py, planner/speed.py), so it adds none; its worker half builds the model from the
model directory as each backend wants it (runtime.py)."""

from __future__ import annotations

from orchestrate.config.schema import RunConfig
from orchestrate.methods.spec import Method


class Full(Method):
    name = "full"
    base = True
    runtime = "orchestrate.methods.full.runtime"

    def active(self, config: RunConfig) -> bool:
        return config.model.module is None and config.train.method not in ("lora", "qlora")


FULL = Full()
