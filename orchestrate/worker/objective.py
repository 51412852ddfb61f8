"""Objectives: what a batch's loss is, and what evaluation measures. An engine calls
`objective.loss(model, batch)` on every training micro-batch and backpropagates it; evaluation
calls `eval_sums(model, batch)` per batch (sums that add up over batches and ranks) and the
Evaluation callback turns their totals into the record's metrics with `metrics(sums, batches)`.
One class per `model.task`, named in `_OBJECTIVES`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from orchestrate.methods.distill.objective import TeacherLogits
    from orchestrate.planner.plan import Plan


class Objective(Protocol):
    name: str

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The scalar loss of one micro-batch (already on the model's device)."""
        ...

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Additive evaluation sums of one batch, "loss" among them; the same keys on every rank."""
        ...

    def metrics(self, sums: dict[str, float], batches: int) -> dict[str, float]:
        """The record's eval_* entries from the sums over `batches` batches of all ranks."""
        ...


class CausalLMObjective:
    """Next-token cross-entropy as the Hugging Face model computes it from `labels` (shifted inside
    the model: `ForCausalLMLoss` in transformers' loss_utils)."""

    name = "causal-lm"

    def __init__(self, loss_chunks: int = 0) -> None:
        self.loss_chunks = loss_chunks
        """0: the model's own loss; N: LM head + cross-entropy in N chunks (worker/chunked_loss.py)."""

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.loss_chunks:
            from orchestrate.worker.chunked_loss import chunked_causal_lm_loss

            return chunked_causal_lm_loss(model, batch, self.loss_chunks)
        # use_cache=False: a KV cache is useless in training and clashes with activation checkpointing.
        return model(**batch, use_cache=False).loss

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"loss": float(self.loss(model, batch).float())}

    def metrics(self, sums: dict[str, float], batches: int) -> dict[str, float]:
        return {"eval_loss": sums["loss"] / batches}


class MaskedLMObjective(CausalLMObjective):
    """Cross-entropy over the masked positions (labels -100 elsewhere: orchestrate.data.mlm), as
    `BertForMaskedLM` computes it; evaluation adds perplexity, exp of the mean eval loss."""

    name = "masked-lm"

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss  # encoders have no KV cache to switch off

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


def objective_for(plan: Plan, teacher: TeacherLogits | None = None) -> Objective:
    """The objective of the plan's task (model.task), or of your own module (train.loss); with
    `distill:` the distillation objective around the task's (orchestrate/methods/distill/objective.py), fed by
    `teacher`."""
    if plan.config.model.module is not None:
        from orchestrate.methods.custom.objective import CustomObjective

        return CustomObjective(plan.config.train.loss)
    if plan.config.distill is not None:  # the KL term needs the student's whole logits: never chunked
        from orchestrate.methods.distill.objective import DistillationObjective

        return DistillationObjective(_OBJECTIVES[plan.config.model.task](), teacher, plan.config.distill)
    if plan.config.model.task == "causal-lm" and plan.chosen is not None:  # the loss in chunks when planned
        return CausalLMObjective(plan.chosen.strategy.loss_chunks)
    return _OBJECTIVES[plan.config.model.task]()
