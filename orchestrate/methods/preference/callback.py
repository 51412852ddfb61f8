"""The preference metrics of every step (objective.py keeps their sums over the step's micro-batches):
added up over the ranks and added to the step's record, before the metrics file and the trackers see
it: loss is the step's as for every run; rewards/chosen, rewards/rejected, rewards/margins,
rewards/accuracies, logps/chosen, logps/rejected, logps_margin (and nll_loss of orpo and rpo_alpha,
orpo's log_odds_ratio, log_odds_chosen; kto's kl) as TRL logs them; and the records the step trained
on, `pairs/step` (kto: `answers/step`): train.global_batch_size, packed or not (samples.py).
Collective: one all-reduce per step."""

from __future__ import annotations

from orchestrate.methods.preference.config import record_noun
from orchestrate.methods.preference.objective import step_metrics
from orchestrate.worker.callbacks.base import Callback, Phase, StepEnd, Training
from orchestrate.worker.metrics import sum_over_ranks


def records_per_step(sums: dict[str, float], loss: str) -> dict[str, int]:
    """The records the step's micro-batches held over every rank, named for what they are."""
    return {f"{record_noun(loss)}/step": round(sums["records"])}


class PreferenceMetrics(Callback):
    phase = Phase.MEASURE

    def on_train_start(self, training: Training) -> None:
        training.engine.objective.take_sums()  # nothing from before the first step

    def on_step_end(self, training: Training, end: StepEnd) -> None:
        objective = training.engine.objective
        sums = sum_over_ranks({key: float(value) for key, value in objective.take_sums().items()}, training.rank.device)
        end.add({**step_metrics(sums, objective.settings.loss), **records_per_step(sums, objective.settings.loss)})
