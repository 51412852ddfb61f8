"""GRPO's advantages and its loss types against hand computations (orchestrate/methods/grpo/losses.py:
DeepSeekMath eq. 3 as TRL's GRPOTrainer computes it)."""

from __future__ import annotations

import math

import pytest
import torch

from orchestrate.methods.grpo.config import GrpoSection
from orchestrate.methods.grpo.losses import STD_EPSILON, group_advantages, policy_loss, zero_std_groups

REWARDS = [{"kind": "format", "pattern": "x"}]


def _settings(**fields) -> GrpoSection:
    return GrpoSection(rewards=REWARDS, **fields)


def test_advantages_are_centred_per_group_and_scaled_as_scale_rewards_says():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    centred = [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]  # group means 0.5 and 2
    # group: group 1's unbiased std sqrt(1/3); group 2's 0 (all alike: advantage 0, whatever it is divided by)
    group_std = math.sqrt(1 / 3)
    assert group_advantages(rewards, 4, "group").tolist() == pytest.approx(
        [a / (group_std + STD_EPSILON) for a in centred])
    # batch: the unbiased std of all 8 rewards (mean 1.25; squares 0.0625 2 x, 1.5625 2 x, 0.5625 4 x; / 7)
    batch_std = math.sqrt((2 * 0.0625 + 2 * 1.5625 + 4 * 0.5625) / 7)
    assert group_advantages(rewards, 4, "batch").tolist() == pytest.approx(
        [a / (batch_std + STD_EPSILON) for a in centred])
    assert group_advantages(rewards, 4, "none").tolist() == pytest.approx(centred)


def test_batch_scaling_divides_by_the_std_of_every_rank_s_rewards():
    """A rank's own groups centred on their own means, divided by the std of the whole step's rewards."""
    mine, theirs = torch.tensor([1.0, 0.0]), torch.tensor([3.0, 3.0])
    every = torch.cat([mine, theirs])
    std = math.sqrt(((1 - 1.75) ** 2 + 1.75 ** 2 + 2 * 1.25 ** 2) / 3)  # mean 1.75, unbiased
    assert group_advantages(mine, 2, "batch", every).tolist() == pytest.approx(
        [0.5 / (std + STD_EPSILON), -0.5 / (std + STD_EPSILON)])


def test_groups_whose_rewards_are_all_alike_are_counted():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    assert zero_std_groups(rewards, 2).tolist() == [True, False, True, True]


@pytest.mark.parametrize(("given", "mode"), [(True, "group"), (False, "none"), ("batch", "batch")])
def test_scale_rewards_takes_trl_s_modes_and_its_booleans(given, mode):
    assert _settings(scale_rewards=given).scale_rewards == mode


def test_scale_rewards_refuses_another_mode():
    with pytest.raises(ValueError, match="scale_rewards"):
        _settings(scale_rewards="prompt")


# Two completions: the first of 3 tokens, the second of 1 (then padding); ratio 1 (the first update).
LOGPS = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])
ADVANTAGES = torch.tensor([2.0, -1.0])


@pytest.mark.parametrize(("loss_type", "expected"), [
    # per token -A: completion 1 three tokens of -2, completion 2 one token of +1
    ("grpo", ((-2 * 3) / 3 + 1 / 1) / 2),         # mean per completion, then over completions
    ("dapo", (-2 * 3 + 1) / 4),                   # over the 4 completion tokens (no step count given)
    ("bnpo", (-2 * 3 + 1) / 4),
    ("dr_grpo", (-2 * 3 + 1) / (2 * 5)),          # completions x max_completion_length (5)
])
def test_each_loss_type_averages_the_token_losses_as_its_paper_does(loss_type, expected):
    out = policy_loss(_settings(loss_type=loss_type, max_completion_length=5), LOGPS, LOGPS, ADVANTAGES, MASK)
    assert float(out.loss) == pytest.approx(expected)
    assert float(out.clip_ratio) == 0.0 and out.kl is None


def test_dapo_divides_by_the_whole_step_s_tokens_and_bnpo_by_each_micro_batch_s():
    """Two micro-batches on each of two ranks, of 4, 1, 2 and 1 completion tokens. The engines average
    the four micro-batch losses (over the accumulation, then the ranks' gradient all-reduce): dapo,
    each sum over the step's 8 tokens shared out over the 4 micro-batches, makes the step's loss the
    sum of every token loss / 8 (TRL's num_items_in_batch); bnpo the mean of the micro-batches' means."""
    token_losses = [[-2.0, -2.0, -2.0, 1.0], [3.0], [0.5, 0.5], [-1.0]]  # -A per token, ratio 1
    dapo, bnpo = _settings(loss_type="dapo"), _settings(loss_type="bnpo")
    step_dapo, step_bnpo = [], []
    for losses in token_losses:  # completions of one token each, so that each token has its own advantage
        logps, advantages = torch.zeros(len(losses), 1), -torch.tensor(losses)
        mask = torch.ones_like(logps)
        step_dapo.append(float(policy_loss(dapo, logps, logps, advantages, mask, dapo_tokens=8 / 4).loss))
        step_bnpo.append(float(policy_loss(bnpo, logps, logps, advantages, mask).loss))
    every = [t for losses in token_losses for t in losses]
    assert sum(step_dapo) / 4 == pytest.approx(sum(every) / 8)
    assert sum(step_bnpo) / 4 == pytest.approx(sum(sum(x) / len(x) for x in token_losses) / 4)
    assert sum(every) / 8 != pytest.approx(sum(step_bnpo) / 4)


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
