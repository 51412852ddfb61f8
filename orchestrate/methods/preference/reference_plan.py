"""The reference model as the launcher checks it before planning: its shape (the model's own, or a
directory of its own sharing the model's tokenizer and vocabulary: a reward is a difference of two
models' log-probabilities of the same token ids) and a placement this run can hold. Reads config.json
and tokenizer files, never weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrate.errors import Problem, UserError
from orchestrate.methods.preference.config import REFERENCE_FREE

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig
    from orchestrate.hardware.profile import HardwareProfile
    from orchestrate.model.shape import ModelShape

_FIX_SAME = ("use a reference trained with the model's tokenizer (its SFT run's RUN_DIR/model), or leave "
             "preference.reference null: the model's initial weights")


def placement_problems(config: RunConfig, hw: HardwareProfile) -> list[Problem]:
    """Every reason this run cannot hold the configured reference placement (auto never has one)."""
    section, problems = config.preference, []
    placement, lora = section.placement, config.train.method in ("lora", "qlora", "auto")
    if config.model.task != "causal-lm" or config.model.module is not None:
        problems.append(Problem("preference", "preference losses compare answer log-probabilities of a causal "
                                "language model", "remove preference, or train a Hugging Face causal LM"))
    if config.distill is not None:
        problems.append(Problem("distill", "distillation and preference tuning in one run",
                                "distil first, then tune preferences on RUN_DIR/model in a second run"))
    if placement == "adapter" and not lora:
        problems.append(Problem("preference.placement", f"adapter is the model with its LoRA adapters disabled; "
                                f"train.method {config.train.method} has none", "set train.method: lora or qlora, "
                                "or preference.placement: auto (replicated, sharded, offload or precomputed)"))
    if placement == "adapter" and section.reference is not None:
        problems.append(Problem("preference.placement", "adapter's reference is the base being adapted, not "
                                f"preference.reference ({section.reference})",
                                "drop preference.reference, or choose replicated, sharded, offload or precomputed"))
    if placement == "sharded" and hw.world_size == 1:
        problems.append(Problem("preference.placement", "sharded splits the reference over the ranks; this plan "
                                "has one", "use replicated, offload or precomputed on one rank (or auto)"))
    if placement == "offload" and not hw.has_gpu:
        problems.append(Problem("preference.placement", "offload keeps the reference's shards in CPU RAM for a GPU "
                                "to gather; these ranks are CPU processes", "use replicated, sharded or precomputed "
                                "(or auto)"))
    return problems


def reference_shape(config: RunConfig, hw: HardwareProfile, shape: ModelShape) -> ModelShape | None:
    """The reference's shape (None: orpo, or the model's own), after every placement and tokenizer
    problem is raised in one UserError."""
    from orchestrate.methods.distill.teacher import frozen_model_shape

    section = config.preference
    problems = placement_problems(config, hw)
    found = None
    if section.loss not in REFERENCE_FREE and section.reference is not None:
        try:
            found = frozen_model_shape(config, shape, config.resolve_path(section.reference), "preference.reference",
                                       "reference model", _FIX_SAME)
        except UserError as err:
            problems += err.problems
    if problems:
        raise UserError("Cannot plan this preference run", problems)
    return found
