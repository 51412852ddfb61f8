"""The preference losses as functions of sequence log-probabilities (docs/preference.md).

A sequence's log-probability is the sum over its answer tokens of log π(token | what precedes it)
(the prompt's tokens are conditioned on, never scored). The definitions, and what is logged, are
TRL's (huggingface/trl; its code is not copied):

- dpo: −(1−ε)·log σ(β·Δ) − ε·log σ(−β·Δ), with Δ = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) −
  log π_ref(y_l)) (Rafailov et al. 2023, eq. 7); ε > 0 is the conservative DPO of the cDPO report
  (E. Mitchell 2023), TRL's `sigmoid` loss with `label_smoothing` (trl v0.20 dpo_trainer.py dpo_loss).
- robust: (−(1−ε)·log σ(β·Δ) + ε·log σ(−β·Δ)) / (1 − 2ε) (Chowdhury et al. 2024, "Provably Robust
  DPO", eq. 8; TRL's `robust`).
- ipo: (Δ̄ − 1/(2β))², Δ̄ the same margin with each log-ratio divided by its answer's token count
  (Azar et al. 2023, eq. 17; TRL's `ipo` averages per token, as its comment says the authors confirmed).
- hinge: max(0, 1 − β·Δ) (the SLiC hinge of Zhao et al. 2023, "SLiC-HF", eq. 1 with the reference's
  log-ratios; TRL's `hinge`, trl v0.20 dpo_trainer.py dpo_loss).
- simpo: −(1−ε)·log σ(β·(ȳ_w − ȳ_l) − γ) − ε·log σ(−β·(ȳ_w − ȳ_l) + γ), ȳ the per-token mean
  log-probability of an answer, no reference model (Meng et al. 2024, "SimPO", eq. 6; TRL's CPOTrainer
  `simpo` with cpo_alpha 0, trl v0.20 cpo_trainer.py cpo_loss: γ/β subtracted inside β·(…)).
- rpo_alpha α (any pairwise loss but orpo): + α·NLL(y_w), the mean over the micro-batch's chosen answer
  tokens of −log π (Pang et al. 2024, "Iterative Reasoning Preference Optimization", v3; trl v0.20
  dpo_trainer.py: concatenated_forward's `nll_loss`, the cross-entropy of the chosen rows' completion
  tokens, added to every pair's loss in get_batch_loss_metrics, so once to their mean).
- orpo: NLL(y_w) − β·log σ(log odds(ȳ_w) − log odds(ȳ_l)), ȳ the per-token mean log-probability and
  log odds(p) = p − log(1 − e^p) (Hong et al. 2024, eqs. 4-7; TRL's ORPOTrainer `odds_ratio_loss`).
  The NLL is the mean cross-entropy of the chosen answers' tokens, where TRL also scores the prompt.
- kto: desirable answers 1 − σ(β·(r − z)), undesirable 1 − σ(β·(z − r)), each weighted, r = log π(y)
  − log π_ref(y) and z = max(0, mean over mismatched (prompt, answer) pairs of the same log-ratio),
  no gradient through z (Ethayarajh et al. 2024, eq. 8; TRL's KTOTrainer `kto` loss).

Rewards (logged as rewards/chosen, rewards/rejected, their margin and the share of pairs whose chosen
reward is higher): β·(log π − log π_ref) per answer; simpo and orpo: β·ȳ (TRL's CPO and ORPO).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from orchestrate.methods.preference.config import PreferenceSection

IGNORE_INDEX = -100


def next_labels(labels: torch.Tensor) -> torch.Tensor:
    """The label each position predicts (the next one; the last position's is IGNORE_INDEX)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each position's next label, whether it is scored), both (rows, positions):
    the causal shift as Hugging Face models make it (logits at t predict the token at t + 1; the last
    position predicts nothing), in fp32 at least. Computed as transformers' ForCausalLMLoss computes
    its cross-entropy (the labels shifted, not the logits), so its temporaries are the ones the memory
    model's logits term counts: none beyond them."""
    targets = next_labels(labels)
    return target_logps(logits, targets), targets != IGNORE_INDEX


def target_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log-probability of each position's target (already shifted; 0 where IGNORE_INDEX), fp32 at least:
    `token_logps` of whole logits, or of one chunk's (the chunked objective: objective.py)."""
    upcast = logits.to(torch.promote_types(logits.dtype, torch.float32))
    per_token = -F.cross_entropy(upcast.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return per_token.view(targets.shape)


def sequence_sums(values: torch.Tensor, sequence: torch.Tensor, count: int) -> torch.Tensor:
    """Per sequence, the sum of `values` (one per position, for the position's next label): `sequence`
    names the sequence of every position (-1: padding), `count` how many there are."""
    owner = F.pad(sequence[:, 1:], (0, 1), value=-1).reshape(-1) + 1  # 0: no sequence
    sums = torch.zeros(count + 1, dtype=values.dtype, device=values.device)
    return sums.index_add(0, owner, values.reshape(-1))[1:]


@dataclass
class AnswerLogps:
    """Sum of log-probabilities and scored tokens of each answer: pairs are chosen then rejected."""

    logps: torch.Tensor
    tokens: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, labels: torch.Tensor, sequence: torch.Tensor, count: int) -> AnswerLogps:
        return cls.of_tokens(*token_logps(logits, labels), sequence, count)

    @classmethod
    def of_tokens(cls, per_token: torch.Tensor, scored: torch.Tensor, sequence: torch.Tensor,
                  count: int) -> AnswerLogps:
        """From each position's log-probability of its next label and whether it is scored."""
        return cls(sequence_sums(per_token, sequence, count), sequence_sums(scored.to(per_token.dtype), sequence, count))

    @staticmethod
    def scored_tokens(labels: torch.Tensor, sequence: torch.Tensor, count: int) -> torch.Tensor:
        """The scored tokens of each sequence (what `of` counts), from the labels alone."""
        return sequence_sums((next_labels(labels) != IGNORE_INDEX).float(), sequence, count)

    def halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.logps.chunk(2)

    def mean_halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.logps / self.tokens.clamp(min=1.0)).chunk(2)


@dataclass
class PairLoss:
    loss: torch.Tensor
    """The micro-batch's scalar loss (mean over its pairs)."""
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    extras: dict[str, torch.Tensor]
    """Further per-batch scalars the loss logs (orpo: nll_loss, log_odds_ratio, log_odds_chosen;
    rpo_alpha: nll_loss)."""


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − e^x) for x < 0, accurate on both sides of −log 2 (Mächler 2012, "Accurately Computing
    log(1 − exp(−|a|))")."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def chosen_nll(policy: AnswerLogps) -> torch.Tensor:
    """The chosen answers' NLL: −Σ log π over their tokens / their token count, the micro-batch's
    token mean (TRL's `nll_loss`: one cross-entropy over the chosen rows' completion tokens)."""
    chosen_sum, _ = policy.halves()
    chosen_tokens, _ = policy.tokens.chunk(2)
    return -chosen_sum.sum() / chosen_tokens.sum().clamp(min=1.0)


def pair_loss(settings: PreferenceSection, policy: AnswerLogps, reference: AnswerLogps | None) -> PairLoss:
    """The loss of a micro-batch of pairs (module docstring); `reference` None for simpo and orpo."""
    beta, eps = settings.beta, settings.label_smoothing
    if settings.loss == "orpo":
        return _orpo(beta, policy)
    if settings.loss == "simpo":
        chosen_mean, rejected_mean = policy.mean_halves()
        logits = beta * (chosen_mean - rejected_mean) - settings.simpo_gamma
        losses = -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
        out = PairLoss(losses.mean(), beta * chosen_mean.detach(), beta * rejected_mean.detach(), {})
    else:
        out = _with_reference(settings, policy, reference)
    if settings.rpo_alpha is not None:
        nll = chosen_nll(policy)
        out.loss = out.loss + settings.rpo_alpha * nll
        out.extras["nll_loss"] = nll.detach()
    return out


def _with_reference(settings: PreferenceSection, policy: AnswerLogps, reference: AnswerLogps) -> PairLoss:
    beta, eps = settings.beta, settings.label_smoothing
    chosen, rejected = policy.halves()
    ref_chosen, ref_rejected = reference.halves()
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    margin = chosen_ratio - rejected_ratio
    if settings.loss == "dpo":
        losses = -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)
    elif settings.loss == "robust":
        losses = (-(1 - eps) * F.logsigmoid(beta * margin) + eps * F.logsigmoid(-beta * margin)) / (1 - 2 * eps)
    elif settings.loss == "hinge":
        losses = torch.relu(1 - beta * margin)
    elif settings.loss == "ipo":
        chosen_tokens, rejected_tokens = policy.tokens.clamp(min=1.0).chunk(2)
        losses = (chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"{settings.loss} is not a pairwise loss")
    return PairLoss(losses.mean(), beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), {})


def _orpo(beta: float, policy: AnswerLogps) -> PairLoss:
    chosen_mean, rejected_mean = policy.mean_halves()
    log_odds = (chosen_mean - rejected_mean) - (_log1mexp(chosen_mean) - _log1mexp(rejected_mean))
    ratio = F.logsigmoid(log_odds)
    nll = chosen_nll(policy)
    return PairLoss(nll - beta * ratio.mean(), beta * chosen_mean.detach(), beta * rejected_mean.detach(),
                    {"nll_loss": nll.detach(), "log_odds_ratio": ratio.mean().detach(),
                     "log_odds_chosen": log_odds.mean().detach()})


@dataclass
class UnpairedLoss:
    loss: torch.Tensor
    rewards: torch.Tensor
    """β·(log π − log π_ref) of every answer."""
    kl: torch.Tensor


def kto_loss(settings: PreferenceSection, policy: torch.Tensor, reference: torch.Tensor, desirable: torch.Tensor,
             kl: torch.Tensor) -> UnpairedLoss:
    """KTO over one micro-batch of single answers: `policy` and `reference` their log-probabilities,
    `desirable` their labels, `kl` the reference point z (already clamped at 0 and detached): the
    mean over answers of the weighted losses (module docstring)."""
    beta = settings.beta
    ratio = policy - reference
    good = settings.desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl)))
    bad = settings.undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio)))
    losses = torch.where(desirable, good, bad)
    return UnpairedLoss(losses.mean(), beta * ratio.detach(), kl)
