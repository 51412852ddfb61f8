"""Preference tuning (`preference:`): DPO and its variants, ORPO, KTO (docs/preference.md). An add-on
method that composes with full fine-tuning and LoRA / QLoRA, owns the objective and runs one auxiliary
model, the reference (orchestrate/methods/spec.py), except for a reference-free loss (simpo, orpo).

Its files: config.py (`preference:`), records.py and samples.py (pairs and labelled answers on the chat
data path), losses.py (the losses as functions of answer log-probabilities), memory.py (what the
method's own tensors and the reference's outputs take), objective.py, reference.py (where a worker's
reference log-probabilities come from), cache.py (the precomputed placement's table), callback.py (the
step's rewards), runtime.py (the worker half). Where the reference lives is priced and built as any
auxiliary model's placement (orchestrate/planner/auxiliary.py, orchestrate/loading/auxiliary.py), plus
`adapter` under LoRA: the trained model with its adapters disabled.
"""

from __future__ import annotations

from typing import Any

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem, UserError
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.methods.auxiliary import frozen_model_shape
from orchestrate.methods.preference.config import REFERENCE_FREE, SEQUENCES_PER_RECORD, record_noun
from orchestrate.methods.preference.memory import REFERENCE, chunked_reference_forward_bytes, reference_model
from orchestrate.methods.spec import Method
from orchestrate.model.shape import ModelShape
from orchestrate.planner.auxiliary import AuxiliaryModel
from orchestrate.planner.memory import compute_bytes
from orchestrate.planner.plan import PlanResult
from orchestrate.planner.strategy import Strategy
from orchestrate.planner.terms import MethodTerms, PricedTerms
from orchestrate.run.layout import REFERENCE_LOGPS_DIR

_FIX_SAME = ("use a reference trained with the model's tokenizer (its SFT run's RUN_DIR/model), or leave "
             "preference.reference null: the model's initial weights")
_LORA = ("lora", "qlora")
_WHY = {"adapter": "the base with the adapters disabled: no extra weights",
        "replicated": "a full copy per rank, the cheapest live reference per step",
        "precomputed": "a first pass before step 1, nothing of the reference held while training"}


def preference_terms(reference: AuxiliaryModel | None, packed: bool, problems: tuple[Problem, ...] = ()) -> MethodTerms:
    """A preference plan: both sequences of every record in the trained model's forward, 2 x
    micro_batch_size rows of seq_len or, packed (data.packing: a micro-batch's micro_batch_size records
    whole in as few blocks of 2 x seq_len as they need, samples.py), micro_batch_size rows of 2 x
    seq_len, the most they can need (every record two sequences of seq_len); the reference as an
    auxiliary model (None: simpo, orpo) and its forward's bytes. With train.loss_chunks the model's and
    a live reference's log-probabilities are computed one chunk of positions at a time (objective.py),
    so the planner's logits term and the reference's forward price one chunk's logits. Its objective
    reads whole sequences (the worker refuses a sequence split); the plan's notes name the longest
    seq_len that fits."""
    return MethodTerms(chunks_loss=True, splits_sequence=False, find_longest_seq_len=True,
                       sample_rows=SEQUENCES_PER_RECORD, packed_rows=packed,
                       auxiliary=(reference,) if reference is not None else (),
                       gpu_keys=("reference_forward",) if reference is not None else (), problems=problems,
                       priced=_reference_forward)


def _reference_forward(terms: MethodTerms, hw: HardwareProfile, rows: Strategy, seq_len: int,
                       accumulation: int) -> PricedTerms:
    """A live reference's forward over the rows of the trained model's forward, before the step's
    activations and logits exist (memory.py); a precomputed one has none."""
    if not terms.auxiliary or terms.auxiliary[0].placement == "precomputed":
        return PricedTerms()
    reference = terms.auxiliary[0]
    held = chunked_reference_forward_bytes(reference.shape, rows.micro_batch_size, seq_len, rows.loss_chunks,
                                           compute_bytes(rows))
    return PricedTerms(before_activations={"reference_forward": held})


_REWARD_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


class Preference(Method):
    name = "preference"
    bases = ("full", "lora")
    objective = True
    runtime = "orchestrate.methods.preference.runtime"
    data = "orchestrate.methods.preference.data"
    saves = (REFERENCE_LOGPS_DIR,)
    metric_keys = ("rewards/", "logps/", "logps_margin", "nll_loss", "log_odds_ratio", "log_odds_chosen", "kl",
                   "pairs/", "answers/")
    """What callback.py records per step (TRL's names, and the records a step trained on)."""

    def active(self, config: RunConfig) -> bool:
        return config.preference is not None

    def record_noun(self, config: RunConfig) -> str:
        """Its records: pairs, or kto's labelled answers."""
        return record_noun(config.preference.loss)

    def run_summary(self, config: RunConfig, records: list[dict[str, Any]]) -> list[str]:
        """The rewards, first step -> last, the records a step trained on, and the held-out rewards of
        the last evaluation."""
        first, last = records[0], records[-1]
        if "rewards/margins" not in last:
            return []
        train = "; ".join(f"{k.split('/')[1]} {first[k]:.4f} -> {last[k]:.4f}" for k in _REWARD_KEYS if k in last)
        lines = [f"- rewards ({config.preference.loss}): {train}"]
        counted = next((key for key in ("pairs/step", "answers/step") if key in last), None)
        if counted is not None:
            lines.append(f"- {counted.split('/')[0]} per step: {last[counted]} (train.global_batch_size "
                         f"{config.train.global_batch_size})")
        evaluated = [r for r in records if r.get("eval_rewards/margins") is not None]
        if evaluated:
            final = evaluated[-1]
            held = "; ".join(f"{k.split('/')[1]} {final['eval_' + k]:.4f}" for k in _REWARD_KEYS if f"eval_{k}" in final)
            lines.append(f"- held-out rewards at step {final['step']}: {held}")
        return lines

    def auxiliary_shapes(self, config: RunConfig, shape: ModelShape) -> dict[str, ModelShape]:
        """The reference's shape: preference.reference's (same tokenizer and vocabulary, checked), or
        the model's own (its initial weights); none for simpo and orpo."""
        section, problems = config.preference, _config_problems(config)
        found = {}
        if section.loss not in REFERENCE_FREE:
            found = {REFERENCE: shape}
            try:
                if section.reference is not None:
                    found = {REFERENCE: frozen_model_shape(config, shape, config.resolve_path(section.reference),
                                                           "preference.reference", "reference model", _FIX_SAME)}
            except UserError as err:
                problems += err.problems
        if problems:  # the settings' and the reference's problems in one error
            raise UserError("Cannot plan this preference run", problems)
        return found

    def terms(self, config: RunConfig, shape: ModelShape, hw: HardwareProfile,
              auxiliary: dict[str, ModelShape]) -> MethodTerms:
        section, problems = config.preference, _config_problems(config)
        if problems:
            raise UserError("Cannot plan this preference run", problems)
        reference = None
        if section.loss not in REFERENCE_FREE:
            reference = reference_model(auxiliary.get(REFERENCE, shape), section.placement,
                                        adapter=config.train.method in _LORA and section.reference is None)
        return preference_terms(reference, config.data.packing, _hardware_problems(config, hw))

    def report(self, plan: PlanResult) -> tuple[list[str], dict[str, Any]]:
        """Where the reference lives in the chosen plan, and why (auto)."""
        loss = plan.config.preference.loss
        chosen = getattr(plan, "chosen", None)
        if loss in REFERENCE_FREE:
            return [f"preference: {loss}, no reference model"], {}
        if chosen is None:
            return [], {}
        placement = chosen.placements.get(REFERENCE, plan.config.preference.placement)
        why = "preference.placement"
        if plan.config.preference.placement == "auto":
            why = "; ".join([*([chosen.placement_reason] if chosen.placement_reason else []),
                             f"{placement}: {_WHY.get(placement, 'the first that fits')}"])
        return [f"preference: {loss}, reference model {placement} ({why})"], {}


def _hardware_problems(config: RunConfig, hw: HardwareProfile) -> tuple[Problem, ...]:
    """Its placement where this hardware cannot run it (one rank to shard over, no GPU to offload to)."""
    placement, problems = config.preference.placement, []
    if placement == "sharded" and hw.world_size == 1:
        problems.append(Problem("preference.placement", "sharded splits the reference over the ranks; this plan "
                                "has one", "use replicated, offload or precomputed on one rank (or auto)"))
    if placement == "offload" and not hw.has_gpu:
        problems.append(Problem("preference.placement", "offload keeps the reference's shards in CPU RAM for a "
                                "GPU to gather; these ranks are CPU processes", "use replicated, sharded or "
                                "precomputed (or auto)"))
    return tuple(problems)


def _config_problems(config: RunConfig) -> list[Problem]:
    """Every problem of the preference settings that needs nothing but the config."""
    section, problems = config.preference, []
    lora = config.train.method in (*_LORA, "auto")
    if config.model.task != "causal-lm":  # your own module is refused with the config (custom/config.py)
        problems.append(Problem("preference", "preference losses compare answer log-probabilities of a causal "
                                "language model", "remove preference, or train a Hugging Face causal LM"))
    if config.distill is not None:
        problems.append(Problem("distill", "distillation and preference tuning in one run",
                                "distil first, then tune preferences on RUN_DIR/model in a second run"))
    if section.placement == "adapter" and not lora:
        problems.append(Problem("preference.placement", "adapter is the model with its LoRA adapters disabled; "
                                f"train.method {config.train.method} has none", "set train.method: lora or qlora, "
                                "or preference.placement: auto (replicated, sharded, offload or precomputed)"))
    if section.placement == "adapter" and section.reference is not None:
        problems.append(Problem("preference.placement", "adapter's reference is the base being adapted, not "
                                f"preference.reference ({section.reference})",
                                "drop preference.reference, or choose replicated, sharded, offload or precomputed"))
    return problems


PREFERENCE = Preference()
