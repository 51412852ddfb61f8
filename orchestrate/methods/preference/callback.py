"""The preference metrics of every step (objective.py keeps their sums over the step's micro-batches):
added up over the ranks and written into the step's record, before the metrics file and the trackers
see it: loss is the step's as for every run; rewards/chosen, rewards/rejected, rewards/margins,
rewards/accuracies, logps/chosen, logps/rejected, logps_margin (and orpo's nll_loss, log_odds_ratio,
log_odds_chosen; kto's kl) as TRL logs them. Collective: one all-reduce per step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrate.methods.preference.objective import PreferenceObjective, step_metrics
from orchestrate.worker.callbacks.base import RunInfo, StepEnd
from orchestrate.worker.metrics import sum_over_ranks

if TYPE_CHECKING:
    import torch


class PreferenceMetrics:
    def __init__(self, objective: PreferenceObjective, device: torch.device):
        self.objective, self.device = objective, device

    def on_train_start(self, run: RunInfo) -> None:
        self.objective.take_sums()  # nothing from before the first step (an evaluation's forward adds none)

    def on_step_end(self, run: RunInfo, end: StepEnd) -> None:
        sums = {key: float(value) for key, value in self.objective.take_sums().items()}
        total = sum_over_ranks(sums, self.device)
        end.record.update(step_metrics(total, self.objective.settings.loss))

    def on_train_end(self, run: RunInfo, stopped_early: bool) -> None:
        pass
