"""The `prune:` section: magnitude or structured pruning on a gradual schedule (docs/pruning.md).

Checks that need the model or the other sections (a schedule past `train.max_steps`, structured
pruning of a family it cannot prune) are in `orchestrate/methods/prune/schedule.py`, at plan time.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from orchestrate.config.section import MAX_COUNT, Section


class PruneScheduleSection(Section):
    start_step: int = Field(default=0, ge=0, le=MAX_COUNT)
    """t0: the step after which pruning begins (sparsity 0 there)."""

    end_step: int = Field(gt=0, le=MAX_COUNT)
    """t0 + n·Δt: the step at which `target_sparsity` is reached; at most `train.max_steps`, and
    the steps after it train the pruned model so the loss recovers."""

    every: int = Field(default=1, gt=0, le=MAX_COUNT)
    """Δt: steps between mask updates (Zhu & Gupta 2017 use 100-1000 on large runs)."""

    @model_validator(mode="after")
    def _ordered(self) -> PruneScheduleSection:
        if self.end_step <= self.start_step:
            raise ValueError(f"end_step ({self.end_step}) must come after start_step ({self.start_step})")
        return self


class PruneSection(Section):
    method: Literal["magnitude", "structured"] = "magnitude"
    """magnitude: zero the smallest weights of the block linears (unstructured; the saved model keeps
    its shape, with zeros). structured: remove whole MLP channels by their L2 norm (Llama-family
    gate/up/down_proj), and query heads with `heads`; the saved model is physically smaller (a
    smaller `intermediate_size`, `num_attention_heads`)."""

    target_sparsity: float = Field(ge=0.0, lt=1.0)
    """s_f: the share of the pruned weights (magnitude) or MLP channels (structured) that is zero at
    `schedule.end_step`."""

    schedule: PruneScheduleSection
    """When: the cubic schedule s_t = s_f (1 - (1 - (t - t0)/(n·Δt))^3) of Zhu & Gupta 2017,
    "To prune, or not to prune", eq. 1 with s_i = 0."""

    heads: bool = False
    """structured only: also remove attention heads, the share `target_sparsity` of the query heads
    of every key/value group (rounded down; q_proj rows and o_proj columns, by their L2 norm); the
    saved config.json gets the smaller `num_attention_heads` and an explicit `head_dim`."""

    scope: Literal["global", "per-layer"] = "global"
    """global: one threshold over every pruned weight (layers end up unequally sparse); per-layer:
    each weight matrix (structured: each block's MLP) pruned to the same sparsity."""
