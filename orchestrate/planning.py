"""The one way a config becomes a plan: model shape (from config.json) -> `make_plan`, used by
`orchestrate plan`, `config`, `launch`, `slurm`, `--resume` and the preset generator alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig
    from orchestrate.hardware.profile import HardwareProfile
    from orchestrate.planner.plan import Plan


def plan_for(config: RunConfig, hardware: HardwareProfile) -> Plan:
    """Every candidate weighed; `chosen` is None when nothing fits (no I/O beyond config.json)."""
    from orchestrate.model.meta import shape_for
    from orchestrate.planner.search import make_plan

    shape = shape_for(config)
    if config.distill is None:
        return make_plan(config, hardware, shape)
    from orchestrate.model.teacher import teacher_shape

    return make_plan(config, hardware, shape, teacher_shape(config, shape))


def feasible_plan(config: RunConfig, hardware: HardwareProfile) -> Plan:
    """`plan_for`, or the UserError that says what does not fit, by how much, and what would."""
    from orchestrate.planner.remedies import require_feasible

    plan = plan_for(config, hardware)
    require_feasible(plan)
    return plan
