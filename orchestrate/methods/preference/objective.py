"""The preference objective: one forward of the model over a micro-batch's sequences (samples.py:
both sequences of every record), answer log-probabilities per sequence, the reference's for the same
sequences (reference.py, computed first under no_grad, so its logits are freed before the model's
forward holds its activations), then the loss of losses.py.

Besides the loss it keeps, per optimizer step, the sums TRL logs per batch (rewards/chosen,
rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected; the nll_loss of
orpo and rpo_alpha, orpo's log_odds_ratio, log_odds_chosen; kto's kl), read and reset by the method's step callback
(callback.py), which adds them up over ranks. Evaluation reports the same over the held-out records,
plus eval_logps_margin: the model's own log π(chosen) − log π(rejected), the preference it has
learnt whatever the reference.

KTO's reference point z is the mean over the micro-batch's mismatched sequences of log π − log π_ref,
averaged over ranks (an all-reduce on every micro-batch, as TRL gathers it), clamped at 0, detached.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from orchestrate.methods.preference.config import UNPAIRED, PreferenceSection
from orchestrate.methods.preference.losses import (
    IGNORE_INDEX,
    AnswerLogps,
    kto_loss,
    next_labels,
    pair_loss,
    target_logps,
)
from orchestrate.worker.chunked_loss import final_hidden_states, over_chunks

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")
ReferenceLogps = Callable[[torch.nn.Module, dict], AnswerLogps]
"""(the trained model, batch) -> the reference's answer log-probabilities of the batch's sequences
(called under no_grad; reference.py; a live one chunked as the model's own where the plan chunks)."""


def answer_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunks: int = 0) -> AnswerLogps:
    """The answer log-probabilities of every sequence of `batch` under `model` (two per record);
    `chunks` > 0 (train.loss_chunks): the LM head and log-probabilities one chunk of positions at a
    time, the full logits never held (worker/chunked_loss.py; checkpointed where autograd records)."""
    inputs = {k: v for k, v in batch.items() if k in MODEL_INPUTS}
    count = 2 * batch["record_index"].numel()
    if not chunks:
        logits = model(**inputs, use_cache=False).logits
        return AnswerLogps.of(logits, batch["labels"], batch["sequence"], count)
    targets = next_labels(batch["labels"])
    with final_hidden_states(model, inputs) as (hidden, head):
        per_token = torch.cat(over_chunks(target_logps, hidden, head, targets, chunks), dim=1)
    return AnswerLogps.of_tokens(per_token, targets != IGNORE_INDEX, batch["sequence"], count)


def _mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value


class PreferenceObjective:
    name = "preference"

    def __init__(self, settings: PreferenceSection, reference: ReferenceLogps | None,
                 eval_reference: ReferenceLogps | None = None, loss_chunks: int = 0) -> None:
        self.settings = settings
        self.loss_chunks = loss_chunks
        """0: whole logits; N: the model's answer log-probabilities in N chunks (`answer_logps`)."""
        self.reference = reference  # None: simpo, orpo
        self.eval_reference = eval_reference or reference
        """The validation records' (a precomputed reference reads another table)."""
        self.sums: dict[str, torch.Tensor] = {}
        """This step's sums so far (callback.py reads and resets them)."""

    def _sums(self, policy: AnswerLogps, reference: AnswerLogps | None,
              batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the loss, its sums for the logged metrics)."""
        if self.settings.loss in UNPAIRED:
            return self._kto(policy, reference, batch["desirable"])
        out = pair_loss(self.settings, policy, reference)
        chosen, rejected = policy.halves()
        margins = out.chosen_rewards - out.rejected_rewards
        sums = {"records": torch.tensor(float(chosen.numel()), device=chosen.device),
                "rewards/chosen": out.chosen_rewards.sum(), "rewards/rejected": out.rejected_rewards.sum(),
                "rewards/margins": margins.sum(), "rewards/accuracies": (margins > 0).float().sum(),
                "logps/chosen": chosen.detach().sum(), "logps/rejected": rejected.detach().sum(),
                "logps_margin": (chosen - rejected).detach().sum()}
        for key, value in out.extras.items():  # batch means: summed per micro-batch, divided by their count
            sums[key] = value
        sums["batches"] = torch.tensor(1.0, device=chosen.device)
        return out.loss, sums

    def _kto(self, policy: AnswerLogps, reference: AnswerLogps, desirable: torch.Tensor):
        own, mismatched = policy.halves()
        ref_own, ref_mismatched = reference.halves()
        kl = _mean_over_ranks((mismatched - ref_mismatched).detach().mean()).clamp(min=0)
        out = kto_loss(self.settings, own, ref_own, desirable, kl)
        good, bad = desirable.float(), (~desirable).float()
        sums = {"records": torch.tensor(float(own.numel()), device=own.device), "desirable": good.sum(),
                "undesirable": bad.sum(), "rewards/chosen": (out.rewards * good).sum(),
                "rewards/rejected": (out.rewards * bad).sum(), "logps/chosen": (own.detach() * good).sum(),
                "logps/rejected": (own.detach() * bad).sum(), "kl": kl, "batches": torch.tensor(1.0, device=own.device)}
        return out.loss, sums

    def _reference(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
                   reference: ReferenceLogps | None) -> AnswerLogps | None:
        if reference is None:
            return None
        with torch.no_grad():
            return reference(model, batch)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        reference = self._reference(model, batch, self.reference)  # first: its logits are gone before the model's forward
        loss, sums = self._sums(answer_logps(model, batch, self.loss_chunks), reference, batch)
        for key, value in sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + value.detach().float()
        return loss

    def take_sums(self) -> dict[str, torch.Tensor]:
        """This step's sums, reset for the next."""
        sums, self.sums = self.sums, {}
        return sums

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        reference = self._reference(model, batch, self.eval_reference)
        loss, sums = self._sums(answer_logps(model, batch, self.loss_chunks), reference, batch)
        return {"loss": float(loss), **{key: float(value) for key, value in sums.items()}}

    def metrics(self, sums: dict[str, float], batches: int) -> dict[str, float]:
        return {"eval_loss": sums["loss"] / batches,
                **{f"eval_{key}": value for key, value in step_metrics(sums, self.settings.loss).items()}}


def step_metrics(sums: dict[str, float], loss: str) -> dict[str, float]:
    """The logged metrics from sums over micro-batches (and ranks): per-record means (kto: the
    rewards and log-probabilities per desirable / undesirable answer, as TRL divides them), batch means
    of the per-batch scalars of orpo, rpo_alpha (nll_loss) and kto."""
    if loss in UNPAIRED:
        out = {"kl": sums["kl"] / sums["batches"]}
        for side, count in (("chosen", sums["desirable"]), ("rejected", sums["undesirable"])):
            if count:
                out[f"rewards/{side}"] = sums[f"rewards/{side}"] / count
                out[f"logps/{side}"] = sums[f"logps/{side}"] / count
        if sums["desirable"] and sums["undesirable"]:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out
    records = sums["records"]
    out = {key: sums[key] / records for key in ("rewards/chosen", "rewards/rejected", "rewards/margins",
                                                 "rewards/accuracies", "logps/chosen", "logps/rejected",
                                                 "logps_margin")}
    for key in ("nll_loss", "log_odds_ratio", "log_odds_chosen"):
        if key in sums:
            out[key] = sums[key] / sums["batches"]
    return out
