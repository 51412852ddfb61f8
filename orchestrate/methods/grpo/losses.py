"""GRPO's advantages and loss as functions of tensors (docs/grpo.md). The definitions are those of
DeepSeekMath (Shao et al. 2024, §4.1, eq. 3) as TRL computes them (huggingface/trl,
trl/trainer/grpo_trainer.py: `_generate_and_score_completions` for the advantages, `_compute_loss`
for the loss); its code is not copied.

- Advantages: per prompt group of G completions, A_i = r_i − mean(r) (outcome supervision: the same A_i
  for every token of completion i), divided by std(r) + 1e-4 with `scale_rewards` (TRL's unbiased std).
- Ratio ρ_t = exp(log π(o_t) − log π_old(o_t)), π_old the policy that sampled the rollouts (detached:
  ρ = 1 at the first update of a batch of rollouts); token loss −min(ρ_t·A, clip(ρ_t, 1 − ε_low, 1 +
  ε_high)·A), plus β·KL_t with the k3 estimator KL_t = exp(q) − q − 1, q = log π_ref − log π (Schulman
  2020, "Approximating KL divergence"; DeepSeekMath eq. 4).
- Aggregation (`loss_type`): grpo, each completion's mean over its tokens, then the mean over
  completions; dr_grpo, the sum over all tokens / (completions × max_completion_length); dapo / bnpo,
  the sum over all tokens / their count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orchestrate.methods.grpo.config import GrpoSection

STD_EPSILON = 1e-4
"""Added to a group's std before dividing (TRL's)."""


def group_advantages(rewards: torch.Tensor, group: int, scale: bool) -> torch.Tensor:
    """Per completion, its reward minus its group's mean (÷ the group's std + 1e-4 with `scale`); the
    completions of a prompt are `group` consecutive entries of `rewards`."""
    grouped = rewards.view(-1, group)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, keepdim=True) + STD_EPSILON)
    return centred.reshape(-1)


@dataclass
class PolicyLoss:
    loss: torch.Tensor
    """The micro-batch's scalar loss."""
    clip_ratio: torch.Tensor
    """Share of completion tokens whose ratio was clipped (the min took the clipped side)."""
    kl: torch.Tensor | None
    """Mean per-token KL to the reference (None: beta 0)."""


def policy_loss(settings: GrpoSection, logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, ref_logps: torch.Tensor | None = None) -> PolicyLoss:
    """The clipped surrogate loss (module docstring) over completion tokens: `logps`, `old_logps`,
    `ref_logps` and `mask` are (completions, tokens), `advantages` (completions,)."""
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.clip_high)
    a = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * a, clipped * a)
    kl = None
    if ref_logps is not None and settings.beta:
        q = ref_logps - logps
        per_token_kl = torch.exp(q) - q - 1
        per_token = per_token + settings.beta * per_token_kl
        kl = (per_token_kl * mask).sum() / mask.sum().clamp(min=1)
    masked = per_token * mask
    if settings.loss_type == "grpo":
        loss = (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    elif settings.loss_type == "dr_grpo":
        loss = masked.sum() / (logps.shape[0] * settings.max_completion_length)
    else:  # dapo, bnpo
        loss = masked.sum() / mask.sum().clamp(min=1)
    is_clipped = ((ratio < 1 - settings.epsilon) & (a < 0)) | ((ratio > 1 + settings.clip_high) & (a > 0))
    clip_ratio = (is_clipped.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)
    return PolicyLoss(loss, clip_ratio.detach(), None if kl is None else kl.detach())
