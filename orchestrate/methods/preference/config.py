"""The `preference:` section: align the model on preferences (docs/preference.md): pairs of a
preferred (chosen) and a dispreferred (rejected) answer to one prompt, or, for KTO, single answers
labelled desirable or not. The loss definitions follow TRL's trainers (losses.py cites each)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from orchestrate.config.section import Section

Loss = Literal["dpo", "robust", "ipo", "hinge", "simpo", "orpo", "kto"]
REFERENCE_FREE: tuple[str, ...] = ("simpo", "orpo")
"""Losses without a reference model."""
UNPAIRED: tuple[str, ...] = ("kto",)
"""Losses over single answers labelled desirable / undesirable instead of pairs."""
SMOOTHED: tuple[str, ...] = ("dpo", "robust", "simpo")
"""Losses that take `label_smoothing` (TRL's sigmoid and robust DPO losses, CPOTrainer's simpo)."""
SEQUENCES_PER_RECORD = 2
"""A pair's chosen and rejected sequence; an unpaired answer and its mismatched one (KTO's KL term)."""

ReferencePlacement = Literal["auto", "adapter", "replicated", "sharded", "offload", "precomputed"]


def record_noun(loss: str) -> str:
    """What a record of this loss is, plural: the preference metrics' `pairs/step` / `answers/step`, the
    worker's start-up line."""
    return "answers" if loss in UNPAIRED else "pairs"


class PreferenceSection(Section):
    loss: Loss = "dpo"
    """dpo: the sigmoid loss of Rafailov et al. 2023, -log σ(β·margin), with `label_smoothing` the
    conservative cDPO of Mitchell 2023; robust: the robust DPO of Chowdhury et al. 2024 (unbiased
    under label noise `label_smoothing`); ipo: Azar et al. 2023, (margin / length − 1/(2β))²; hinge:
    the SLiC hinge of Zhao et al. 2023, max(0, 1 − β·margin); simpo: Meng et al. 2024, −log σ(β·(mean
    log π(chosen) − mean log π(rejected)) − γ), per-token means, no reference model; orpo: Hong et al.
    2024, the chosen answer's NLL plus β times an odds-ratio term, no reference model; kto: Ethayarajh
    et al. 2024, single answers labelled desirable or not (records with a `label`)."""

    beta: float = Field(default=0.1, gt=0, le=100)
    """β: how far the model may move from the reference (dpo, robust, hinge, kto: the reward is
    β·(log π − log π_ref); ipo: the regularisation τ; simpo: the scale of the per-token mean log π,
    2 to 2.5 in the SimPO paper; orpo: the odds-ratio term's weight λ)."""

    rpo_alpha: float | None = Field(default=None, ge=0, le=100)
    """α of RPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization", v3; TRL's
    DPOConfig.rpo_alpha): loss + α · NLL of the chosen answers (their tokens' mean cross-entropy over
    the micro-batch). It keeps the chosen answers likely, which plain DPO does not: DPO can widen the
    margin by making both answers unlikely, down to a model that answers nothing. null: no NLL term
    (TRL's default); the paper recommends 1.0. Pairwise losses only (orpo has its own NLL term)."""

    simpo_gamma: float = Field(default=0.5, ge=0, le=100)
    """simpo: γ, the target reward margin (TRL's CPOConfig.simpo_gamma, default 0.5)."""

    label_smoothing: float = Field(default=0.0, ge=0.0, lt=0.5)
    """ε, the probability that a pair's preference is flipped (dpo: cDPO; robust; simpo: as dpo, TRL's CPO). 0:
    labels trusted."""

    reference: str | None = None
    """The frozen reference model: a local Hugging Face model directory with the model's tokenizer and
    vocabulary (checked at plan time); null: the model's initial weights (`model.name_or_path`, the
    SFT run's RUN_DIR/model). Relative paths are resolved against the YAML file's directory."""

    placement: ReferencePlacement = "auto"
    """Where the reference lives. adapter: LoRA / QLoRA only, the model itself with its adapters
    disabled (no extra weights: the reference is the frozen base, as TRL does with peft; QLoRA's base
    is the NF4-rounded one). replicated: a full copy per rank. sharded: FSDP2 over the ranks, gathered
    a block at a time. offload: sharded with its shards in CPU RAM. precomputed: a first pass writes
    the reference log-probabilities of every pair into RUN_DIR/reference_logps and training reads
    them (reused on resume; redone when the data or the reference change). auto: adapter where it
    applies, else the first of replicated, sharded, offload and precomputed that fits, per strategy.
    simpo and orpo have no reference (leave it auto)."""

    desirable_weight: float = Field(default=1.0, gt=0, le=100)
    """kto: weight of the desirable answers' losses (to balance unequal counts: KTO paper, eq. 8)."""

    undesirable_weight: float = Field(default=1.0, gt=0, le=100)
    """kto: weight of the undesirable answers' losses."""

    @model_validator(mode="after")
    def _settings_of_the_loss(self) -> PreferenceSection:
        # By value, not by the fields given: plan.json writes every field back.
        if self.loss in REFERENCE_FREE and (self.reference is not None or self.placement != "auto"):
            raise ValueError(f"loss {self.loss} has no reference model: drop preference.reference and "
                             "preference.placement")
        if self.label_smoothing and self.loss not in SMOOTHED:
            raise ValueError(f"label_smoothing is for the {', '.join(SMOOTHED)} losses, not {self.loss}: drop it")
        if self.rpo_alpha is not None and self.loss in ("orpo", *UNPAIRED):
            raise ValueError(f"rpo_alpha adds an NLL term to a pairwise loss; {self.loss} has its own or none: drop it")
        if self.simpo_gamma != 0.5 and self.loss != "simpo":
            raise ValueError("simpo_gamma is for loss simpo: drop it")
        if self.loss not in UNPAIRED and (self.desirable_weight, self.undesirable_weight) != (1.0, 1.0):
            raise ValueError("desirable_weight and undesirable_weight are for loss kto: drop them")
        return self
