"""Objectives: what a batch's loss is, and what evaluation measures. An engine calls
`objective.loss(model, batch)` on every training micro-batch and backpropagates it; evaluation
calls `eval_sums(model, batch)` per batch (sums that add up over batches and ranks) and the
Evaluation callback turns their totals into the record's metrics with `metrics(sums, batches)`.
One class per `model.task`, named in `_OBJECTIVES`; a training method's objective (distillation,
your own module's loss) lives in its folder and takes the task's place through its runtime's
`objective` hook (`objective_for`). An objective that measures more per step (a preference method's
rewards) keeps its sums and a MEASURE-phase callback of its method adds them to the step's record.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from orchestrate.backends.base import Objective
from orchestrate.backends.sequence_parallel import SequenceParallel, group_sum, group_tokens
from orchestrate.errors import Problem, UserError
from orchestrate.methods.registry import active_methods, runtimes
from orchestrate.worker.chunked_loss import chunked_causal_lm_loss

if TYPE_CHECKING:
    import torch

    from orchestrate.planner.plan import RunPlan


def loss_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens of a causal-LM batch that carry loss: labels other than -100 after the model's shift (a
    sequence-parallel slice's shifted already: its share of the sequence's)."""
    if "shift_labels" in batch:
        return int((batch["shift_labels"] != -100).sum())
    return int((batch["labels"][..., 1:] != -100).sum())


class CausalLMObjective:
    """Next-token cross-entropy as the Hugging Face model computes it from `labels` (shifted inside
    the model: `ForCausalLMLoss` in transformers' loss_utils)."""

    name = "causal-lm"

    def __init__(self, loss_chunks: int = 0, sequence: SequenceParallel | None = None) -> None:
        self.loss_chunks = loss_chunks
        """0: the model's own loss; N: LM head + cross-entropy in N chunks (worker/chunked_loss.py)."""
        self.sequence = sequence
        """Sequence parallelism: each batch is this rank's slice; the loss is the whole sequences'."""

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.sequence is not None:
            return self._sequence_loss(model, batch)
        if self.loss_chunks:
            return chunked_causal_lm_loss(model, batch, self.loss_chunks)
        # use_cache=False: a KV cache is useless in training and clashes with activation checkpointing.
        return model(**batch, use_cache=False).loss

    def _sequence_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The mean over the group's whole sequences: each slice's summed cross-entropy over the group's
        token count, summed over the group (backends/sequence_parallel.py: why the gradients are right)."""
        tokens = group_tokens(batch["shift_labels"], self.sequence)
        if self.loss_chunks:
            share = chunked_causal_lm_loss(model, batch, self.loss_chunks, tokens)
        else:  # labels only switch the model's loss on: it scores shift_labels, summed over num_items_in_batch
            share = model(**batch, use_cache=False, num_items_in_batch=tokens).loss
        return group_sum(share, self.sequence)

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        loss, tokens = float(self.loss(model, batch).float()), float(loss_tokens(batch))
        # A batch without a loss-carrying token has a nan mean; it adds nothing to the token-weighted sum.
        # Under sequence parallelism `loss` is the whole sequences' and `tokens` this slice's: summed over
        # the group's ranks they weight it by the whole sequences' tokens, once.
        return {"loss": loss, "loss_sum": loss * tokens if tokens else 0.0, "loss_tokens": tokens}

    def metrics(self, sums: dict[str, float], batches: int) -> dict[str, float]:
        """eval_loss: the mean over every loss-carrying token (the answers of chat samples), weighted
        by tokens across batches (for packed plain text, whose blocks all count seq_len - 1, the mean of
        the batches' means)."""
        if not sums.get("loss_tokens"):
            return {"eval_loss": sums["loss"] / batches}
        return {"eval_loss": sums["loss_sum"] / sums["loss_tokens"], "eval_loss_tokens": int(sums["loss_tokens"])}


class MaskedLMObjective(CausalLMObjective):
    """Cross-entropy over the masked positions (labels -100 elsewhere: orchestrate.data.mlm), as
    `BertForMaskedLM` computes it; evaluation adds perplexity, exp of the mean eval loss."""

    name = "masked-lm"

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss  # encoders have no KV cache to switch off

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"loss": float(self.loss(model, batch).float())}

    def metrics(self, sums: dict[str, float], batches: int) -> dict[str, float]:
        eval_loss = sums["loss"] / batches
        return {"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 700.0))}  # exp(710) overflows


class SequenceClassificationObjective:
    """Cross-entropy of the document's label (`BertForSequenceClassification` with integer labels:
    single_label_classification); evaluation adds accuracy and macro-F1 (the unweighted mean of
    the per-class F1 = 2TP / (2TP + FP + FN), as sklearn's f1_score(average="macro"), classes that
    never occur in predictions or labels left out)."""

    name = "sequence-classification"

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        out = model(**batch)
        predicted, labels = out.logits.argmax(-1), batch["labels"]
        sums = {"loss": float(out.loss.float()), "correct": float((predicted == labels).sum()),
                "count": float(labels.numel())}
        for c in range(out.logits.shape[-1]):
            sums[f"tp_{c}"] = float(((predicted == c) & (labels == c)).sum())
            sums[f"fp_{c}"] = float(((predicted == c) & (labels != c)).sum())
            sums[f"fn_{c}"] = float(((predicted != c) & (labels == c)).sum())
        return sums

    def metrics(self, sums: dict[str, float], batches: int) -> dict[str, float]:
        classes = sorted({int(k.split("_")[1]) for k in sums if k.startswith("tp_")})
        f1 = []
        for c in classes:
            denominator = 2 * sums[f"tp_{c}"] + sums[f"fp_{c}"] + sums[f"fn_{c}"]
            if denominator:
                f1.append(2 * sums[f"tp_{c}"] / denominator)
        return {"eval_loss": sums["loss"] / batches, "eval_accuracy": sums["correct"] / max(sums["count"], 1.0),
                "eval_macro_f1": sum(f1) / len(f1) if f1 else 0.0}


_OBJECTIVES = {o.name: o for o in (CausalLMObjective, MaskedLMObjective, SequenceClassificationObjective)}


def plain_objective(plan: RunPlan) -> Objective:
    """The objective of the plan's task (model.task), the loss never chunked."""
    return _OBJECTIVES[plan.config.model.task]()


def task_objective(plan: RunPlan, sequence: SequenceParallel | None = None) -> Objective:
    """The objective of the plan's task, the causal-LM loss in chunks where the plan chunks it, over
    the whole sequences of a sequence-parallel group where there is one."""
    if plan.config.model.task == "causal-lm":
        return CausalLMObjective(plan.strategy.loss_chunks, sequence)
    return plain_objective(plan)


def objective_for(plan: RunPlan, auxiliary: dict[str, Any] | None = None,
                  sequence: SequenceParallel | None = None) -> Objective:
    """The task's objective, then every active method's say in hook order (your own module's loss;
    distillation around the task's, fed by its teacher in `auxiliary`: methods/runtime.py).
    `sequence`: this rank's sequence-parallel group (`Rank.sequence`)."""
    task = task_objective(plan, sequence)
    objective = task
    for method, runtime in zip(active_methods(plan.config), runtimes(plan.config), strict=True):
        objective = runtime.objective(plan, objective, (auxiliary or {}).get(method.name))
    if sequence is not None and objective is not task:
        # A method's own loss (distillation's KL, preference's log-probabilities) sees one slice of each
        # sequence and would need its own reduction over the group.
        raise UserError("sequence parallelism trains the causal-LM loss only", [Problem(
            "train.sequence_parallel", f"the {objective.name} objective does not reduce over a sequence split "
            "across ranks", "set train.sequence_parallel: 1")])
    return objective
