"""The GRPO metrics of every step (objective.py keeps their sums over the step's micro-batches and adds
them up over the ranks): added to the step's record before the metrics file and the trackers see it,
under TRL's names (reward, reward_std, rewards/<name>/mean, completions/mean_length,
completions/clipped_ratio, kl, clip_ratio). Collective: one all-reduce per step. The preference
method's step callback with another record (its phase, and the sums dropped before step 1)."""

from __future__ import annotations

from orchestrate.methods.preference.callback import PreferenceMetrics


class GrpoMetrics(PreferenceMetrics):
    def on_step_end(self, training, end) -> None:  # (Training, StepEnd): worker/callbacks/base.py
        end.add(training.engine.objective.take_metrics(training.rank.device))
