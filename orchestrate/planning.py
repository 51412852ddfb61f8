"""The planner's public API: the one way a config becomes a plan, used by `orchestrate plan`, `config`,
`launch`, `slurm`, `--resume` and the preset generator alike.

model shape (from config.json) -> the methods' auxiliary models' shapes (their config.json) -> every
active training method's terms (orchestrate/methods/registry.py), computed here once per plan -> the
search (planner/search.py `make_plan`), which reads them as values and never calls a method. What the
planner needs of the methods beyond a plan's terms comes from here too: the configs they offer when
nothing fits (the remedies), and what they say about a plan (the report).
"""

from __future__ import annotations

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem, UserError
from orchestrate.hardware.profile import HardwareProfile, MemoryCorrection
from orchestrate.methods.registry import (
    active_methods,
    auto_note,
    auto_variants,
    auxiliary_shapes,
    is_auto,
    method_terms,
    methods,
    no_auto_method,
)
from orchestrate.model.meta import shape_for
from orchestrate.model.shape import ModelShape
from orchestrate.planner import search
from orchestrate.planner.plan import PlanResult, Refusal, RunPlan
from orchestrate.planner.remedies import infeasible_error
from orchestrate.planner.terms import MethodReport


def plan_for(config: RunConfig, hardware: HardwareProfile) -> RunPlan | Refusal:
    """Every candidate weighed: the runnable plan, or the Refusal when nothing fits (no I/O beyond config.json)."""
    return plan_with_shape(config, hardware, shape_for(config))


def plan_with_shape(config: RunConfig, hardware: HardwareProfile, shape: ModelShape) -> RunPlan | Refusal:
    """`weigh` with the shapes of the methods' auxiliary models (the distillation teacher's, and the
    check that teacher and student share a vocabulary), and a note for each measured correction applied."""
    plan = weigh(config, hardware, shape, auxiliary_shapes(config, shape))
    plan.notes += [correction_note(c) for c in hardware.memory_corrections]
    if config.train.num_epochs is not None:  # the samples an epoch has are known once the data is prepared
        plan.notes.append(f"length: {config.train.length()}: ceil(num_epochs x ceil(training samples / "
                          f"global_batch_size {config.train.global_batch_size}))")
    return plan


def weigh(config: RunConfig, hardware: HardwareProfile, shape: ModelShape,
          auxiliary: dict[str, ModelShape] | None = None, *, fitting_only: bool = False) -> RunPlan | Refusal:
    """Every candidate, best first (planner/search.py `make_plan`), with the config's training methods'
    terms (a UserError for method settings that do not fit the model); no I/O. `auxiliary`: the shapes
    of the methods' auxiliary models (None: planned without them); `fitting_only` as for `make_plan`.
    train.method auto: the plan of the first method that fits (`_auto_plan`)."""
    if is_auto(config):
        return _auto_plan(config, hardware, shape, auxiliary)
    return search.make_plan(config, hardware, shape, method_terms(config, shape, hardware, auxiliary),
                            fitting_only)


def _auto_plan(config: RunConfig, hardware: HardwareProfile, shape: ModelShape,
               auxiliary: dict[str, ModelShape] | None) -> RunPlan | Refusal:
    """The auto method: the plan of the first method in methods/registry.py AUTO_METHODS that fits, with
    a note saying which and why; if none fits, the last one planned (the closest to fitting)."""
    variants, why = auto_variants(config)
    plan = None
    for method, variant in variants:
        try:
            attempt = weigh(variant, hardware, shape, auxiliary)
        except UserError as err:  # e.g. a family LoRA is not planned for, or pins this method cannot train under
            why.append(f"{method}: {err.problems[0].message if err.problems else err.headline}")
            continue
        plan = attempt
        if isinstance(plan, RunPlan):
            plan.notes.append(auto_note(method, why))
            return plan
        why.append(f"{method} does not fit (closest: {plan.candidates[0].name}: {plan.candidates[0].reason})")
    if plan is None:
        raise no_auto_method(why)
    plan.notes.append(auto_note(None, why, plan.config))
    return plan


def correction_note(correction: MemoryCorrection) -> str:
    """What `orchestrate plan` says about a measured correction it applied."""
    family = f"{correction.family} plans" if correction.family else "every plan"
    return (f"memory: measured correction x{correction.ratio:.2f} on the per-rank prediction of {family}, "
            f"from {correction.source}" + (f" ({correction.reason})" if correction.reason else ""))


def require_feasible(plan: RunPlan | Refusal) -> RunPlan:
    """The runnable plan, or for a Refusal its `refusal_error`. Call it before launching."""
    if isinstance(plan, RunPlan):
        return plan
    raise refusal_error(plan)


def refusal_error(plan: Refusal) -> UserError:
    """The `UserError` (exit 2) naming the closest candidates, by how much each overflows, and concrete
    remedies: variations of the config and hardware re-planned (`weigh`), and the configs the training
    methods offer instead (Method.alternatives)."""
    return infeasible_error(plan, weigh, [a for m in methods() for a in m.alternatives(plan.config)])


def feasible_plan(config: RunConfig, hardware: HardwareProfile) -> RunPlan:
    """`plan_for`, or the UserError that says what does not fit, by how much, and what would."""
    return require_feasible(plan_for(config, hardware))


def method_reports(plan: PlanResult) -> list[MethodReport]:
    """What the plan's training methods say about it, in hook order (planner/report.py prints them)."""
    return [method.report(plan) for method in active_methods(plan.config)]


def check_seq_len(config: RunConfig, shape: ModelShape) -> None:
    """A seq_len past max_position_embeddings: learned positions (GPT-2) index out of range, RoPE
    models run past the lengths they were trained for. Outside `weigh`: the launcher reports it with the
    data section's problems (`check_data_config`), which a UserError from planning would hide."""
    limit, seq_len = shape.max_position_embeddings, config.train.seq_len
    if limit and seq_len > limit:
        raise UserError("train.seq_len does not fit the model", [Problem(
            "train.seq_len", f"{seq_len} is longer than the model's max_position_embeddings {limit}",
            f"use train.seq_len <= {limit}")])
