"""The preference losses equal a hand computation (plain Python floats, the papers' formulas) from
fixed policy and reference log-probabilities, for every variant; the log-probabilities of answers
are the sums over their scored tokens, one sequence never leaking into another."""

from __future__ import annotations

import math

import pytest
import torch

from orchestrate.methods.preference.config import PreferenceSection
from orchestrate.methods.preference.losses import AnswerLogps, kto_loss, pair_loss, sequence_sums, token_logps

# Three pairs: log π of the chosen answers, of the rejected ones; the same under the reference; answer lengths.
CHOSEN = [-12.5, -30.25, -7.0]
REJECTED = [-14.0, -28.5, -9.75]
REF_CHOSEN = [-13.0, -29.0, -8.5]
REF_REJECTED = [-13.5, -29.25, -9.0]
CHOSEN_TOKENS = [5.0, 11.0, 3.0]
REJECTED_TOKENS = [6.0, 9.0, 4.0]


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _answers(chosen, rejected, chosen_tokens=CHOSEN_TOKENS, rejected_tokens=REJECTED_TOKENS) -> AnswerLogps:
    return AnswerLogps(torch.tensor(chosen + rejected, dtype=torch.float32),
                       torch.tensor(chosen_tokens + rejected_tokens, dtype=torch.float32))


def _margins() -> list[float]:
    return [(c - rc) - (r - rr) for c, r, rc, rr in zip(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, strict=True)]


def _loss(**settings) -> float:
    out = pair_loss(PreferenceSection(**settings), _answers(CHOSEN, REJECTED), _answers(REF_CHOSEN, REF_REJECTED))
    return float(out.loss)


@pytest.mark.parametrize(("beta", "eps"), [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2)])
def test_dpo_is_the_sigmoid_loss_with_conservative_label_smoothing(beta, eps):
    hand = sum(-(1 - eps) * _logsig(beta * m) - eps * _logsig(-beta * m) for m in _margins()) / 3
    assert _loss(loss="dpo", beta=beta, label_smoothing=eps) == pytest.approx(hand, abs=1e-6)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_robust_dpo_removes_the_flip_bias(eps):
    beta = 0.25
    hand = sum((-(1 - eps) * _logsig(beta * m) + eps * _logsig(-beta * m)) / (1 - 2 * eps) for m in _margins()) / 3
    assert _loss(loss="robust", beta=beta, label_smoothing=eps) == pytest.approx(hand, abs=1e-6)


def test_ipo_squares_the_per_token_margin_minus_half_over_beta():
    beta = 0.1
    hand = 0.0
    for c, r, rc, rr, nc, nr in zip(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, CHOSEN_TOKENS, REJECTED_TOKENS,
                                    strict=True):
        hand += ((c - rc) / nc - (r - rr) / nr - 1 / (2 * beta)) ** 2
    assert _loss(loss="ipo", beta=beta) == pytest.approx(hand / 3, abs=1e-6)


def test_hinge_is_the_slic_hinge_of_the_margin():
    beta = 0.5  # margins 2.0, -0.5, 2.25: one pair past the hinge (1 - 0.5 * 2.25 < 0)
    hand = sum(max(0.0, 1 - beta * m) for m in _margins()) / 3
    assert _loss(loss="hinge", beta=beta) == pytest.approx(hand, abs=1e-6)


@pytest.mark.parametrize(("beta", "gamma", "eps"), [(2.0, 0.5, 0.0), (2.5, 1.0, 0.0), (2.0, 0.5, 0.1)])
def test_simpo_is_the_sigmoid_loss_of_the_per_token_means_less_gamma_without_a_reference(beta, gamma, eps):
    hand, chosen_rewards = 0.0, []
    for c, r, nc, nr in zip(CHOSEN, REJECTED, CHOSEN_TOKENS, REJECTED_TOKENS, strict=True):
        x = beta * (c / nc - r / nr) - gamma
        hand += -(1 - eps) * _logsig(x) - eps * _logsig(-x)
        chosen_rewards.append(beta * c / nc)
    out = pair_loss(PreferenceSection(loss="simpo", beta=beta, simpo_gamma=gamma, label_smoothing=eps),
                    _answers(CHOSEN, REJECTED), None)
    assert float(out.loss) == pytest.approx(hand / 3, abs=1e-6)
    assert out.chosen_rewards.tolist() == pytest.approx(chosen_rewards, abs=1e-6)


@pytest.mark.parametrize("loss", ["dpo", "hinge", "ipo", "simpo"])
def test_rpo_alpha_adds_alpha_times_the_chosen_token_mean_nll(loss):
    alpha = 0.7
    nll = -sum(CHOSEN) / sum(CHOSEN_TOKENS)  # TRL: one cross-entropy over all chosen answer tokens
    reference = None if loss == "simpo" else _answers(REF_CHOSEN, REF_REJECTED)
    beta = 2.0 if loss == "simpo" else 0.1
    plain = pair_loss(PreferenceSection(loss=loss, beta=beta), _answers(CHOSEN, REJECTED), reference)
    out = pair_loss(PreferenceSection(loss=loss, beta=beta, rpo_alpha=alpha), _answers(CHOSEN, REJECTED), reference)
    assert float(out.loss) == pytest.approx(float(plain.loss) + alpha * nll, abs=1e-6)
    assert float(out.extras["nll_loss"]) == pytest.approx(nll, abs=1e-6)
    assert out.chosen_rewards.tolist() == plain.chosen_rewards.tolist()  # the rewards are the loss's own


@pytest.mark.parametrize(("settings", "word"), [
    ({"loss": "orpo", "rpo_alpha": 1.0}, "rpo_alpha"), ({"loss": "kto", "rpo_alpha": 1.0}, "rpo_alpha"),
    ({"loss": "dpo", "simpo_gamma": 1.0}, "simpo_gamma"), ({"loss": "hinge", "label_smoothing": 0.1}, "label_smoothing"),
    ({"loss": "simpo", "reference": "ref"}, "reference")])
def test_settings_of_another_loss_are_refused(settings, word):
    with pytest.raises(ValueError, match=word):
        PreferenceSection(**settings)


def test_rewards_are_beta_times_the_log_ratios():
    out = pair_loss(PreferenceSection(beta=0.3), _answers(CHOSEN, REJECTED), _answers(REF_CHOSEN, REF_REJECTED))
    assert out.chosen_rewards.tolist() == pytest.approx([0.3 * (c - r) for c, r in zip(CHOSEN, REF_CHOSEN, strict=True)], abs=1e-6)
    assert out.rejected_rewards.tolist() == pytest.approx([0.3 * (c - r) for c, r in zip(REJECTED, REF_REJECTED, strict=True)],
                                                          abs=1e-6)


def test_orpo_is_the_chosen_nll_plus_the_odds_ratio_term():
    beta = 0.1
    # per-token means must be log-probabilities of a token (< 0), as they are for real answers
    ratios, odds = [], []
    for c, r, nc, nr in zip(CHOSEN, REJECTED, CHOSEN_TOKENS, REJECTED_TOKENS, strict=True):
        mc, mr = c / nc, r / nr
        log_odds = (mc - math.log(1 - math.exp(mc))) - (mr - math.log(1 - math.exp(mr)))
        odds.append(log_odds)
        ratios.append(_logsig(log_odds))
    nll = -sum(CHOSEN) / sum(CHOSEN_TOKENS)
    out = pair_loss(PreferenceSection(loss="orpo", beta=beta), _answers(CHOSEN, REJECTED), None)
    assert float(out.loss) == pytest.approx(nll - beta * sum(ratios) / 3, abs=1e-6)
    assert float(out.extras["nll_loss"]) == pytest.approx(nll, abs=1e-6)
    assert float(out.extras["log_odds_chosen"]) == pytest.approx(sum(odds) / 3, abs=1e-6)
    assert out.chosen_rewards.tolist() == pytest.approx(
        [beta * c / n for c, n in zip(CHOSEN, CHOSEN_TOKENS, strict=True)], abs=1e-6)


def test_orpo_log_odds_stay_finite_near_certainty():
    near_one = AnswerLogps(torch.tensor([-1e-7, -50.0]), torch.tensor([1.0, 1.0]))
    out = pair_loss(PreferenceSection(loss="orpo"), near_one, None)
    assert torch.isfinite(out.loss)


def test_kto_weights_desirable_and_undesirable_answers_around_the_reference_point():
    beta, kl, wd, wu = 0.1, 0.4, 1.0, 1.33
    policy, reference = [-10.0, -20.0, -5.0, -8.0], [-11.0, -18.0, -5.5, -7.0]
    desirable = [True, False, True, False]
    hand = 0.0
    for p, r, good in zip(policy, reference, desirable, strict=True):
        z = p - r
        hand += wd * (1 - 1 / (1 + math.exp(-beta * (z - kl)))) if good else \
            wu * (1 - 1 / (1 + math.exp(-beta * (kl - z))))
    out = kto_loss(PreferenceSection(loss="kto", beta=beta, desirable_weight=wd, undesirable_weight=wu),
                   torch.tensor(policy), torch.tensor(reference), torch.tensor(desirable), torch.tensor(kl))
    assert float(out.loss) == pytest.approx(hand / 4, abs=1e-6)


def test_answer_log_probs_are_the_sums_over_scored_tokens_of_each_sequence():
    torch.manual_seed(0)
    vocab = 7
    logits = torch.randn(2, 6, vocab, dtype=torch.float64)
    ids = torch.randint(0, vocab, (2, 6))
    labels = torch.full_like(ids, -100)
    # row 0 holds two sequences packed: positions 0-2 (answer at 2) and 3-5 (answer at 4, 5); row 1 is padding
    labels[0, 2], labels[0, 4], labels[0, 5] = ids[0, 2], ids[0, 4], ids[0, 5]
    sequence = torch.tensor([[0, 0, 0, 1, 1, 1], [-1] * 6])

    def logp(row: int, t: int) -> float:  # the token at t under the logits at t - 1, by hand
        z = logits[row, t - 1].tolist()
        return z[ids[row, t]] - math.log(sum(math.exp(v) for v in z))

    out = AnswerLogps.of(logits, labels, sequence, 2)
    assert out.logps.tolist() == pytest.approx([logp(0, 2), logp(0, 4) + logp(0, 5)], abs=1e-9)
    assert out.tokens.tolist() == [1.0, 2.0]


def test_token_log_probs_are_zero_where_nothing_is_scored():
    logits = torch.randn(1, 4, 5)
    labels = torch.tensor([[-100, 3, -100, 1]])
    per_token, scored = token_logps(logits, labels)
    assert scored.tolist() == [[True, False, True, False]]  # position t scores label t + 1
    assert per_token[0, 1].item() == per_token[0, 3].item() == 0.0
    assert sequence_sums(per_token, torch.tensor([[0, 0, 0, 0]]), 1).item() == pytest.approx(
        per_token.sum().item())
