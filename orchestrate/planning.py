"""The one way a config becomes a plan: model shape (from config.json) -> the methods' auxiliary
models' shapes -> `make_plan`, used by `orchestrate plan`, `config`, `launch`, `slurm`, `--resume` and
the preset generator alike."""

from __future__ import annotations

from orchestrate.config.schema import RunConfig
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.methods.registry import auxiliary_shapes
from orchestrate.model.meta import shape_for
from orchestrate.model.shape import ModelShape
from orchestrate.planner.plan import Refusal, RunPlan
from orchestrate.planner.remedies import require_feasible
from orchestrate.planner.search import make_plan


def plan_for(config: RunConfig, hardware: HardwareProfile) -> RunPlan | Refusal:
    """Every candidate weighed: the runnable plan, or the Refusal when nothing fits (no I/O beyond config.json)."""
    return plan_with_shape(config, hardware, shape_for(config))


def plan_with_shape(config: RunConfig, hardware: HardwareProfile, shape: ModelShape) -> RunPlan | Refusal:
    """`make_plan` with the shapes of the methods' auxiliary models (the distillation teacher's, and
    the check that teacher and student share a vocabulary)."""
    return make_plan(config, hardware, shape, auxiliary_shapes(config, shape))


def feasible_plan(config: RunConfig, hardware: HardwareProfile) -> RunPlan:
    """`plan_for`, or the UserError that says what does not fit, by how much, and what would."""
    return require_feasible(plan_for(config, hardware))
