"""The objective of your own module (`model.module`): the loss of `train.loss`
(orchestrate.methods.custom.loss); evaluation adds accuracy when the output has logits and the
batch has integer labels of one class per sample."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrate.methods.custom.loss import LABELS, logits_of, loss_and_output

if TYPE_CHECKING:
    import torch


class CustomObjective:
    name = "custom"

    def __init__(self, mode: str = "auto") -> None:
        self.mode = mode

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return loss_and_output(model, batch, self.mode)[0]

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        loss, output = loss_and_output(model, batch, self.mode)
        sums = {"loss": float(loss.detach().float())}
        logits, labels = logits_of(output), batch.get(LABELS)
        if logits is not None and labels is not None and labels.dim() == 1 and logits.shape[:1] == labels.shape:
            sums["correct"] = float((logits.argmax(-1) == labels).sum())
            sums["count"] = float(labels.numel())
        return sums

    def metrics(self, sums: dict[str, float], batches: int) -> dict[str, float]:
        out = {"eval_loss": sums["loss"] / batches}
        if "count" in sums:
            out["eval_accuracy"] = sums["correct"] / max(sums["count"], 1.0)
        return out
