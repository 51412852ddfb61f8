"""Distillation on the worker: the teacher, an auxiliary model built where the plan places it before
the student (orchestrate/loading/auxiliary.py), or for the precomputed placement a first pass into
RUN_DIR/teacher_cache (cache.py) and its reader; the distillation objective around the task's
(objective.py), fed by it."""

from __future__ import annotations

import torch

from orchestrate.backends.base import Objective
from orchestrate.backends.rank import Rank
from orchestrate.data.pipeline import TrainData
from orchestrate.loading.auxiliary import build_frozen, lean_placement, placement_on
from orchestrate.methods.distill.cache import TeacherCache, write_cache
from orchestrate.methods.distill.method import TEACHER
from orchestrate.methods.distill.objective import DistillationObjective, TeacherLogits, live_teacher
from orchestrate.methods.distill.teacher import teacher_dir
from orchestrate.methods.runtime import MethodRuntime
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import RunDir
from orchestrate.worker.objective import plain_objective


def teacher_placement(plan: RunPlan, device: torch.device, world_size: int) -> str:
    """The placement this worker builds the teacher at (loading/auxiliary.py placement_on)."""
    return placement_on(plan, TEACHER, plan.config.distill.placement, device, world_size)


def build_teacher(plan: RunPlan, device: torch.device, world_size: int, placement: str) -> torch.nn.Module:
    return build_frozen(plan, teacher_dir(plan.config), device, world_size, placement)


class DistillRuntime(MethodRuntime):
    def auxiliary(self, plan: RunPlan, rank: Rank, run: RunDir, data: TrainData) -> TeacherLogits:
        """The teacher's logits per batch: a live teacher, or the precomputed cache (collective)."""
        world, device = rank.world_size, rank.device
        placement = teacher_placement(plan, device, world)
        if placement != "precomputed":
            return live_teacher(build_teacher(plan, device, world, placement))
        teacher = build_teacher(plan, device, world, lean_placement(device, world))
        write_cache(plan, run.path, data, teacher, device, rank.rank, world)
        del teacher  # freed before the student is built: the point of precomputing
        return TeacherCache(plan, run.path, data)

    def objective(self, plan: RunPlan, task: Objective, auxiliary: TeacherLogits) -> Objective:
        # The KL needs the student's whole logits: around the task's objective unchunked.
        return DistillationObjective(plain_objective(plan), auxiliary, plan.config.distill)


RUNTIME = DistillRuntime()
