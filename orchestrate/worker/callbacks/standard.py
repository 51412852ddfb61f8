"""The built-in step callbacks (`orchestrate.worker.callbacks.base` describes the protocol and the
phases): evaluation, metrics file, progress, checkpoints, stop signals."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrate.report.progress_text import memory_and_mfu
from orchestrate.run.checkpoints import latest_checkpoint, read_meta
from orchestrate.run.layout import REQUEUE_FILE, write_requeue
from orchestrate.worker.callbacks.base import Callback, Phase, StepEnd, Training
from orchestrate.worker.metrics import MetricsWriter, sum_over_ranks
from orchestrate.worker.progress import ProgressDisplay

if TYPE_CHECKING:
    import torch


class Evaluation(Callback):
    """Mean loss over `train.eval_batches` validation batches every `train.eval_every` steps and at
    the end; skipped when the run is stopping early (the grace period is for the checkpoint).
    Collective: every rank evaluates its share and the mean is all-reduced."""

    phase = Phase.MEASURE

    def __init__(self) -> None:
        self.batches: list[dict[str, torch.Tensor]] = []

    def on_train_start(self, training: Training) -> None:
        micro, device = training.plan.strategy.micro_batch_size, training.rank.device
        self.batches = [{k: v.to(device, non_blocking=True) for k, v in b.items()} for b in
                        training.data.eval_batches(micro, training.plan.config.train.eval_batches,
                                                   training.rank.data_rank, training.rank.data_world_size)]

    def on_step_end(self, training: Training, end: StepEnd) -> None:
        every = training.plan.config.train.eval_every
        if not self.batches or (end.stopping and not end.final):
            return
        if (every and end.step % every == 0) or end.final:
            sums: dict[str, float] = {}
            for b in self.batches:
                for key, value in training.engine.eval_sums(b).items():
                    sums[key] = sums.get(key, 0.0) + value
            # Every rank evaluates the same number of batches, so the summed loss over all batches
            # is the mean of the ranks' means (what eval_loss has always been).
            total = sum_over_ranks(sums, training.rank.device)
            end.add(training.engine.objective.metrics(total, len(self.batches) * training.rank.world_size))


class MetricsFile(Callback):
    """Rank 0 appends every step's record to RUN_DIR/metrics.jsonl (see MetricsWriter)."""

    def __init__(self) -> None:
        self.writer: MetricsWriter | None = None

    def on_train_start(self, training: Training) -> None:
        if training.rank.is_main:
            self.writer = MetricsWriter(training.run.metrics, resume_step=training.start_step)

    def on_step_end(self, training: Training, end: StepEnd) -> None:
        if self.writer is not None:
            self.writer.write(end.record)

    def on_train_end(self, training: Training, stopped_early: bool) -> None:
        if self.writer is not None:
            self.writer.close()


class Progress(Callback):
    """Rank 0's progress lines (or bar on a terminal)."""

    def __init__(self, intro: list[str]):
        self.intro = intro
        self.display: ProgressDisplay | None = None

    def on_train_start(self, training: Training) -> None:
        self.display = ProgressDisplay(training.plan.config.train.max_steps, enabled=training.rank.is_main)
        for line in self.intro:
            self.display.message(line)

    def on_step_end(self, training: Training, end: StepEnd) -> None:
        r = end.record
        self.display.update(end.step, r["loss"], r["tokens_per_s"], r.get("eval_loss"), memory_and_mfu(r, training.plan))

    def on_train_end(self, training: Training, stopped_early: bool) -> None:
        if self.display is not None:
            self.display.close()


class Checkpoints(Callback):
    """A checkpoint every `train.checkpoint_every` steps and at the end. Collective."""

    phase = Phase.PERSIST

    def on_step_end(self, training: Training, end: StepEnd) -> None:
        every = training.plan.config.train.checkpoint_every
        if (every and end.step % every == 0) or end.final:
            training.checkpointer.save(end.step, training.data.sampler.state_dict())
            end.checkpointed = True


class StopOnSignal(Callback):
    """After a stop signal on any rank: checkpoint (unless this step has one, or the grace period
    would run out while writing it), leave the REQUEUE marker and end the loop. Every rank decides
    alike: the inputs were all-reduced (StopRequest.agreed)."""

    phase = Phase.STOP

    def __init__(self) -> None:
        self.record: dict | None = None
        """What the REQUEUE marker says, once the loop stopped early."""

    def on_step_end(self, training: Training, end: StepEnd) -> None:
        if not end.stopping or end.final:
            return
        grace = training.plan.config.train.preemption_grace_s
        save_s, run_dir, request = end.slowest_save_s, training.run.path, training.stop
        if not end.checkpointed and (save_s is None or end.signal_waited_s + save_s < grace):
            training.checkpointer.save(end.step, training.data.sampler.state_dict())
        elif not end.checkpointed and training.rank.is_main:
            print(f"orchestrate: no checkpoint at step {end.step}: {end.signal_waited_s:.0f} s since the signal + "
                  f"{save_s:.0f} s to write one exceeds train.preemption_grace_s={grace}", flush=True)
        latest = latest_checkpoint(run_dir)
        self.record = {"step": read_meta(latest).step if latest else 0, "stopped_at": end.step,
                       "signal": request.signal_name, "checkpoint": str(latest) if latest else None}
        if training.rank.is_main:
            write_requeue(run_dir, self.record)
            print(f"stopped by {request.signal_name or 'a signal'} after step {end.step}; resume from step "
                  f"{self.record['step']} ({run_dir / REQUEUE_FILE})", flush=True)
        end.stop = True
