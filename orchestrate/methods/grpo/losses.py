"""GRPO's advantages and loss as functions of tensors (docs/grpo.md). The definitions are those of
DeepSeekMath (Shao et al. 2024, §4.1, eq. 3) as TRL computes them (huggingface/trl at f2cd577,
trl/trainer/grpo_trainer.py: `_generate_and_score_completions` for `num_items_in_batch`, the completion
tokens of the generation batch gathered over the processes (line 2427), the advantages by
`scale_rewards` (2687-2707) and `frac_reward_zero_std` (2750); `_compute_loss` for the loss types
(3123-3148: dapo's `normalizer = num_items_in_batch / num_processes`, 3139-3141)); its code is not copied.

- Advantages: per prompt group of G completions, A_i = r_i − mean(r) (outcome supervision: the same A_i
  for every token of completion i), divided by a std + 1e-4 per `scale_rewards` (TRL's unbiased std):
  group, the group's; batch, that of every reward of the step; none, no division.
- Ratio ρ_t = exp(log π(o_t) − log π_old(o_t)), π_old the policy that sampled the rollouts (detached:
  ρ = 1 at the first update of a batch of rollouts); token loss −min(ρ_t·A, clip(ρ_t, 1 − ε_low, 1 +
  ε_high)·A), plus β·KL_t with the k3 estimator KL_t = exp(q) − q − 1, q = log π_ref − log π (Schulman
  2020, "Approximating KL divergence"; DeepSeekMath eq. 4).
- Aggregation (`loss_type`): grpo, each completion's mean over its tokens, then the mean over
  completions; dr_grpo, the sum over all tokens / (completions × max_completion_length); bnpo, the sum
  over the micro-batch's tokens / their count; dapo, the sum / `dapo_tokens`, the step's completion
  tokens over every micro-batch and rank shared out per micro-batch (TRL: `num_items_in_batch /
  num_processes`; with the engines' mean over micro-batches and ranks the step's loss is the sum of
  every token loss of the step over its token count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orchestrate.methods.grpo.config import GrpoSection, ScaleRewards

STD_EPSILON = 1e-4
"""Added to a group's std before dividing (TRL's)."""


def group_advantages(rewards: torch.Tensor, group: int, scale: ScaleRewards,
                     batch: torch.Tensor | None = None) -> torch.Tensor:
    """Per completion, its reward minus its group's mean, ÷ (a std + 1e-4) per `scale` (module
    docstring); the completions of a prompt are `group` consecutive entries of `rewards`. `batch`: every
    reward of the step, all ranks' (scale "batch"; default `rewards`)."""
    grouped = rewards.view(-1, group)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + STD_EPSILON)
    elif scale == "batch":
        centred = centred / ((rewards if batch is None else batch).std() + STD_EPSILON)
    return centred.reshape(-1)


def zero_std_groups(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """(groups,) bool: the groups whose completions all scored alike (std 0 as TRL's `torch.isclose`):
    their advantages are 0, they teach nothing (TRL's frac_reward_zero_std is their share)."""
    std = rewards.view(-1, group).std(dim=1)
    return torch.isclose(std, torch.zeros_like(std))


@dataclass
class PolicyLoss:
    loss: torch.Tensor
    """The micro-batch's scalar loss."""
    clip_ratio: torch.Tensor
    """Share of completion tokens whose ratio was clipped (the min took the clipped side)."""
    kl: torch.Tensor | None
    """Mean per-token KL to the reference (None: beta 0)."""


def policy_loss(settings: GrpoSection, logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, ref_logps: torch.Tensor | None = None,
                dapo_tokens: float | None = None) -> PolicyLoss:
    """The clipped surrogate loss (module docstring) over completion tokens: `logps`, `old_logps`,
    `ref_logps` and `mask` are (completions, tokens), `advantages` (completions,); `dapo_tokens`: what
    dapo divides the sum by (None: this micro-batch's token count, bnpo's)."""
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
    elif settings.loss_type == "dapo" and dapo_tokens is not None:
        loss = masked.sum() / dapo_tokens
    else:  # bnpo (and dapo over one micro-batch: an evaluation's)
        loss = masked.sum() / mask.sum().clamp(min=1)
    is_clipped = ((ratio < 1 - settings.epsilon) & (a < 0)) | ((ratio > 1 + settings.clip_high) & (a > 0))
    clip_ratio = (is_clipped.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)
    return PolicyLoss(loss, clip_ratio.detach(), None if kl is None else kl.detach())
