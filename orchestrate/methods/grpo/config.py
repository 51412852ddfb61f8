"""The `grpo:` section: online reinforcement learning with Group Relative Policy Optimization
(Shao et al. 2024, "DeepSeekMath", §4.1; docs/grpo.md). Field names and defaults follow TRL's
`GRPOConfig` (huggingface/trl, trl/trainer/grpo_config.py): num_generations, max_completion_length,
temperature, top_p, beta, epsilon, epsilon_high, loss_type, scale_rewards, num_iterations. The
rewards need no code unless one names your own function (`kind: function`, behind the config's one
code opt-in, model.trust_remote_code: docs/security.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from orchestrate.config.section import Section

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo"]
ScaleRewards = Literal["group", "batch", "none"]
RewardKind = Literal["exact_match", "format", "length", "function"]


class RewardSection(Section):
    """One reward function; the rewards of a completion are weighted and summed (TRL's reward_weights)."""

    kind: RewardKind
    """exact_match: 1 where the completion (or `pattern`'s first group in it) equals the record's
    `column`, stripped, else 0. format: 1 where `pattern` matches the completion (re.search), else 0.
    length: −max(0, tokens − `target_tokens`) / target_tokens, a penalty for completions past a length.
    function: your own `function` ("package.module:name"), called as TRL calls a reward function:
    f(prompts=[...], completions=[...], **columns) -> one float per completion."""

    weight: float = 1.0
    """Its weight in the sum."""
    column: str | None = None
    """exact_match: the record's column holding the expected answer."""
    pattern: str | None = None
    """exact_match: a regex whose first group is the answer (none: the whole completion); format: the
    regex the completion must contain."""
    target_tokens: int | None = Field(default=None, gt=0)
    """length: the completion length, in tokens, past which the penalty grows."""
    function: str | None = None
    """function: "package.module:name" (imported only with model.trust_remote_code: true)."""
    name: str | None = None
    """Its name in the metrics (rewards/<name>/mean); default: the kind, or the function's name."""

    @model_validator(mode="after")
    def _fields_of_the_kind(self) -> RewardSection:
        needed = {"exact_match": ("column",), "format": ("pattern",), "length": ("target_tokens",),
                  "function": ("function",)}[self.kind]
        missing = [f for f in needed if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.kind} reward needs {' and '.join(missing)}")
        allowed = {"exact_match": {"column", "pattern"}, "format": {"pattern"}, "length": {"target_tokens"},
                   "function": {"function"}}[self.kind]
        extra = [f for f in ("column", "pattern", "target_tokens", "function") if f not in allowed
                 and getattr(self, f) is not None]
        if extra:
            raise ValueError(f"a {self.kind} reward takes no {' or '.join(extra)}")
        return self

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return self.function.rpartition(":")[2] if self.function else self.kind


class GrpoSection(Section):
    num_generations: int = Field(default=8, ge=2, le=1024)
    """Completions sampled per prompt (the group G): the advantages compare them with each other."""

    max_completion_length: int = Field(default=256, gt=0)
    """Tokens a completion may have (generation stops there, or at EOS / the end of the turn). The
    prompt keeps its last train.seq_len − max_completion_length tokens (TRL cuts prompts on the left)."""

    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1.0)

    beta: float = Field(default=0.0, ge=0)
    """Weight of the KL divergence to the reference (TRL's default 0: no reference model). The
    reference is the model's initial weights: under LoRA / QLoRA the base with its adapters disabled."""

    epsilon: float = Field(default=0.2, gt=0, lt=1)
    """The clipping range's lower side: the ratio π/π_old is clipped at 1 − epsilon."""
    epsilon_high: float | None = Field(default=None, gt=0)
    """The upper side (DAPO's clip-higher, Yu et al. 2025); null: epsilon."""

    loss_type: LossType = "dapo"
    """How token losses are averaged (TRL's loss_type, trl/trainer/grpo_trainer.py `_compute_loss`): grpo,
    per completion then over completions (DeepSeekMath eq. 3); dr_grpo, summed and divided by
    completions × max_completion_length (Liu et al. 2025, "Understanding R1-Zero-Like Training"); dapo,
    summed over the step and divided by the completion tokens of the whole step, every micro-batch of
    every rank (Yu et al. 2025; TRL's `num_items_in_batch`); bnpo, divided by the completion tokens of
    each micro-batch alone."""

    scale_rewards: ScaleRewards = "group"
    """What each completion's centred reward (its reward minus its group's mean) is divided by, + 1e-4
    (TRL's GRPOConfig.scale_rewards): group, the standard deviation of its group's rewards
    (DeepSeekMath); batch, the standard deviation of every reward of the step over all ranks (TRL's
    "batch", after "PPO Lite", Liu et al. 2025); none, nothing (Dr. GRPO: the std scaling biases towards
    questions that are too easy or too hard). true and false are group and none, as in TRL."""

    num_iterations: int = Field(default=1, ge=1, le=64)
    """Policy updates per batch of rollouts (TRL's μ): the rollouts and their log-probabilities under
    the policy that sampled them are kept for this many optimizer steps."""

    rewards: list[RewardSection] = Field(min_length=1)
    """The reward functions, weighted and summed."""

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _boolean_scale(cls, value: object) -> object:
        """TRL's booleans: true is "group", false is "none"."""
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
