"""The one way a config becomes a plan: model shape (from config.json) -> `make_plan`, used by
`orchestrate plan`, `config`, `launch`, `slurm`, `--resume` and the preset generator alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig
    from orchestrate.hardware.profile import HardwareProfile
    from orchestrate.model.shape import ModelShape
    from orchestrate.planner.plan import Plan


def plan_for(config: RunConfig, hardware: HardwareProfile) -> Plan:
    """Every candidate weighed; `chosen` is None when nothing fits (no I/O beyond config.json)."""
    from orchestrate.model.meta import shape_for

    return plan_with_shape(config, hardware, shape_for(config))


def plan_with_shape(config: RunConfig, hardware: HardwareProfile, shape: ModelShape) -> Plan:
    """`make_plan` with the distillation teacher's shape (and the check that teacher and student
    share a vocabulary) when the config has a `distill:` section."""
    from orchestrate.planner.search import make_plan

    if config.distill is None:
        return make_plan(config, hardware, shape)
    from orchestrate.methods.distill.teacher import teacher_shape

    return make_plan(config, hardware, shape, teacher_shape(config, shape))


def feasible_plan(config: RunConfig, hardware: HardwareProfile) -> Plan:
    """`plan_for`, or the UserError that says what does not fit, by how much, and what would."""
    from orchestrate.planner.remedies import require_feasible

    plan = plan_for(config, hardware)
    require_feasible(plan)
    return plan
