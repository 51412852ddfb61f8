"""The distillation teacher as the planner sees it: its directory and its shape, read and checked
(same vocabulary and tokenizer as the student) as any auxiliary model's (orchestrate/methods/auxiliary.py).
Launcher side; reads config.json and tokenizer files, never weights."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.errors import Problem, UserError
from orchestrate.methods.auxiliary import frozen_model_shape

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig
    from orchestrate.model.shape import ModelShape

_FIX_SAME = ("distill from a teacher trained with the student's tokenizer (set data.tokenizer to the teacher's "
             "tokenizer directory, or train the teacher with this data section)")


def teacher_dir(config: RunConfig) -> Path:
    return config.resolve_path(config.distill.teacher)


def teacher_shape(config: RunConfig, student: ModelShape) -> ModelShape:
    """The teacher's shape; UserError listing every problem: no such directory, another task, a
    vocabulary or tokenizer that differs from the student's (the KL compares the two distributions
    id by id, so id i must be the same token in both)."""
    if config.model.task != "causal-lm":
        raise UserError("distillation is planned for causal language models", [Problem(
            "distill", f"model.task is {config.model.task}; the soft-target loss compares next-token distributions",
            "remove distill, or use model.task: causal-lm")])
    return frozen_model_shape(config, student, teacher_dir(config), "distill.teacher", "teacher", _FIX_SAME)
