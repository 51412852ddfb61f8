"""GRPO's advantages and its loss types against hand computations (orchestrate/methods/grpo/losses.py:
DeepSeekMath eq. 3 as TRL's GRPOTrainer computes it)."""

from __future__ import annotations

import math

import pytest
import torch

from orchestrate.methods.grpo.config import GrpoSection
from orchestrate.methods.grpo.losses import STD_EPSILON, group_advantages, policy_loss

REWARDS = [{"kind": "format", "pattern": "x"}]


def _settings(**fields) -> GrpoSection:
    return GrpoSection(rewards=REWARDS, **fields)


def test_advantages_are_centred_and_scaled_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: all equal, advantage 0
    std = math.sqrt(1 / 3)
    expected = [0.5 / (std + STD_EPSILON), -0.5 / (std + STD_EPSILON), -0.5 / (std + STD_EPSILON),
                0.5 / (std + STD_EPSILON), 0.0, 0.0, 0.0, 0.0]
    assert group_advantages(rewards, 4, scale=True).tolist() == pytest.approx(expected)
    assert group_advantages(rewards, 4, scale=False).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


# Two completions: the first of 3 tokens, the second of 1 (then padding); ratio 1 (the first update).
LOGPS = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])
ADVANTAGES = torch.tensor([2.0, -1.0])


@pytest.mark.parametrize(("loss_type", "expected"), [
    # per token -A: completion 1 three tokens of -2, completion 2 one token of +1
    ("grpo", ((-2 * 3) / 3 + 1 / 1) / 2),         # mean per completion, then over completions
    ("dapo", (-2 * 3 + 1) / 4),                   # over the 4 completion tokens
    ("bnpo", (-2 * 3 + 1) / 4),
    ("dr_grpo", (-2 * 3 + 1) / (2 * 5)),          # completions x max_completion_length (5)
])
def test_each_loss_type_averages_the_token_losses_as_its_paper_does(loss_type, expected):
    out = policy_loss(_settings(loss_type=loss_type, max_completion_length=5), LOGPS, LOGPS, ADVANTAGES, MASK)
    assert float(out.loss) == pytest.approx(expected)
    assert float(out.clip_ratio) == 0.0 and out.kl is None


def test_the_ratio_is_clipped_on_the_advantage_s_side_with_epsilon_high():
    settings = _settings(epsilon=0.2, epsilon_high=0.3, loss_type="dapo")
    old = torch.zeros(2, 1)
    logps = torch.log(torch.tensor([[1.5], [0.5]]))  # ratios 1.5 and 0.5
    mask = torch.ones(2, 1)
    out = policy_loss(settings, logps, old, torch.tensor([1.0, -1.0]), mask)
    # A > 0, ratio 1.5: min(1.5, 1.3) = 1.3 -> -1.3; A < 0, ratio 0.5: -min(-0.5, -0.8) = 0.8
    assert float(out.loss) == pytest.approx((-1.3 + 0.8) / 2)
    assert float(out.clip_ratio) == 1.0
    inside = policy_loss(settings, torch.log(torch.tensor([[1.25], [0.9]])), old, torch.tensor([1.0, -1.0]), mask)
    assert float(inside.clip_ratio) == 0.0


def test_the_gradient_at_the_first_update_is_the_policy_gradient():
    """Ratio 1 (π_old = π detached): d loss / d logp = -A per token over the token count (dapo)."""
    logps = LOGPS.clone().requires_grad_()
    policy_loss(_settings(loss_type="dapo"), logps, logps.detach(), ADVANTAGES, MASK).loss.backward()
    assert logps.grad.flatten().tolist() == pytest.approx([-0.5, -0.5, -0.5, 0.25, 0.0, 0.0])


def test_beta_adds_the_k3_estimate_of_the_kl_to_the_reference():
    settings = _settings(beta=0.5, loss_type="dapo")
    logps, ref = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])
    q = -1.0  # log π_ref - log π
    kl = math.exp(q) - q - 1
    out = policy_loss(settings, logps, logps, torch.tensor([0.0]), torch.ones(1, 1), ref)
    assert float(out.kl) == pytest.approx(kl)
    assert float(out.loss) == pytest.approx(0.5 * kl)
