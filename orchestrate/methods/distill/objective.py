"""The distillation objective (Hinton et al. 2015, "Distilling the Knowledge in a Neural Network"):

    loss = alpha · CE(student, labels) + (1 − alpha) · T² · KL(softmax(teacher/T) ‖ softmax(student/T))

averaged over the tokens the loss covers (attention_mask where there is one). T² keeps the soft
term's gradients the size of the hard term's as T changes (the paper, section 2). With a
precomputed teacher only its top-k logits per token are known: the teacher's distribution is
renormalised over those k ids and the KL runs over them (the student's log-probabilities still
come from its full softmax), as Axolotl's KD plugin does with cached top-k log-probs.

Evaluation measures the student alone (the task objective's plain cross-entropy), so a distilled
and an undistilled run report comparable eval_loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from orchestrate.backends.base import Objective
    from orchestrate.methods.distill.config import DistillSection

TeacherLogits = Callable[[dict], "tuple[torch.Tensor, torch.Tensor | None]"]
"""batch -> (teacher logits, None) for a live teacher, or (top-k logits, their token ids) from the cache."""


def soft_target_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, ids: torch.Tensor | None,
                   temperature: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over the masked tokens of KL(softmax(teacher/T) ‖ softmax(student/T)), over the full
    vocabulary, or over the teacher's top-k `ids` (teacher renormalised over them)."""
    import torch.nn.functional as F

    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    if ids is not None:
        student = student.gather(-1, ids)
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    per_token = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1)
    if mask is None:
        return per_token.mean()
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


class DistillationObjective:
    name = "distillation"

    def __init__(self, task: Objective, teacher: TeacherLogits, settings: DistillSection) -> None:
        self.task = task  # the model.task's objective: evaluation measures the student alone
        self.teacher = teacher
        self.temperature = settings.temperature
        self.alpha = settings.alpha

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch

        out = model(**batch, use_cache=False)
        with torch.no_grad():
            teacher_logits, ids = self.teacher(batch)
        kl = soft_target_kl(out.logits, teacher_logits, ids, self.temperature, batch.get("attention_mask"))
        return self.alpha * out.loss + (1 - self.alpha) * self.temperature ** 2 * kl

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        return self.task.eval_sums(model, batch)

    def metrics(self, sums: dict[str, float], batches: int) -> dict[str, float]:
        return self.task.metrics(sums, batches)


def live_teacher(teacher: torch.nn.Module) -> TeacherLogits:
    """The logits of a teacher module that runs on every micro-batch (collective when sharded:
    every rank calls it once per micro-batch)."""
    def logits(batch: dict) -> tuple[torch.Tensor, None]:
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
        return teacher(**inputs, use_cache=False).logits, None

    return logits
