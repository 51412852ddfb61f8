"""The built-in step callbacks, in the order the loop calls them: evaluation, metrics file,
progress, checkpoints, stop signals (`orchestrate.worker.callbacks.base` describes the protocol)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.report.progress_text import memory_and_mfu
from orchestrate.run.checkpoints import latest_checkpoint, read_meta
from orchestrate.run.layout import REQUEUE_FILE, write_requeue
from orchestrate.worker.callbacks.base import RunInfo, StepEnd
from orchestrate.worker.metrics import MetricsWriter, sum_over_ranks
from orchestrate.worker.progress import ProgressDisplay

if TYPE_CHECKING:
    import torch

    from orchestrate.backends.base import TrainEngine
    from orchestrate.data.pipeline import TrainData
    from orchestrate.worker.checkpointing import Checkpointer
    from orchestrate.worker.signals import StopRequest


class Evaluation:
    """Mean loss over `train.eval_batches` validation batches every `train.eval_every` steps and at
    the end; skipped when the run is stopping early (the grace period is for the checkpoint).
    Collective: every rank evaluates its share and the mean is all-reduced."""

    def __init__(self, engine: TrainEngine, data: TrainData, device: torch.device):
        self.engine, self.data, self.device = engine, data, device
        self.batches: list[dict[str, torch.Tensor]] = []

    def on_train_start(self, run: RunInfo) -> None:
        micro = run.plan.chosen.strategy.micro_batch_size
        self.batches = [{k: v.to(self.device, non_blocking=True) for k, v in b.items()} for b in
                        self.data.eval_batches(micro, run.plan.config.train.eval_batches, run.rank, run.world_size)]

    def on_step_end(self, run: RunInfo, end: StepEnd) -> None:
        every = run.plan.config.train.eval_every
        if not self.batches or (end.stopping and not end.final):
            return
        if (every and end.step % every == 0) or end.final:
            sums: dict[str, float] = {}
            for b in self.batches:
                for key, value in self.engine.eval_sums(b).items():
                    sums[key] = sums.get(key, 0.0) + value
            # Every rank evaluates the same number of batches, so the summed loss over all batches
            # is the mean of the ranks' means (what eval_loss has always been).
            total = sum_over_ranks(sums, self.device)
            end.record.update(self.engine.objective.metrics(total, len(self.batches) * run.world_size))

    def on_train_end(self, run: RunInfo, stopped_early: bool) -> None:
        pass


class MetricsFile:
    """Rank 0 appends every step's record to RUN_DIR/metrics.jsonl (see MetricsWriter)."""

    def __init__(self, path: Path):
        self.path = path
        self.writer: MetricsWriter | None = None

    def on_train_start(self, run: RunInfo) -> None:
        if run.is_main:
            self.writer = MetricsWriter(self.path, resume_step=run.start_step)

    def on_step_end(self, run: RunInfo, end: StepEnd) -> None:
        if self.writer is not None:
            self.writer.write(end.record)

    def on_train_end(self, run: RunInfo, stopped_early: bool) -> None:
        if self.writer is not None:
            self.writer.close()


class Progress:
    """Rank 0's progress lines (or bar on a terminal)."""

    def __init__(self, intro: list[str]):
        self.intro = intro
        self.display: ProgressDisplay | None = None

    def on_train_start(self, run: RunInfo) -> None:
        self.display = ProgressDisplay(run.plan.config.train.max_steps, enabled=run.is_main)
        for line in self.intro:
            self.display.message(line)

    def on_step_end(self, run: RunInfo, end: StepEnd) -> None:
        r = end.record
        self.display.update(end.step, r["loss"], r["tokens_per_s"], r.get("eval_loss"), memory_and_mfu(r, run.plan))

    def on_train_end(self, run: RunInfo, stopped_early: bool) -> None:
        if self.display is not None:
            self.display.close()


class Checkpoints:
    """A checkpoint every `train.checkpoint_every` steps and at the end. Collective."""

    def __init__(self, checkpointer: Checkpointer, data: TrainData):
        self.checkpointer, self.data = checkpointer, data

    def on_train_start(self, run: RunInfo) -> None:
        pass

    def on_step_end(self, run: RunInfo, end: StepEnd) -> None:
        every = run.plan.config.train.checkpoint_every
        if (every and end.step % every == 0) or end.final:
            self.checkpointer.save(end.step, self.data.sampler.state_dict())
            end.checkpointed = True

    def on_train_end(self, run: RunInfo, stopped_early: bool) -> None:
        pass


class StopOnSignal:
    """After a stop signal on any rank: checkpoint (unless this step has one, or the grace period
    would run out while writing it), leave the REQUEUE marker and end the loop. Every rank decides
    alike: the inputs were all-reduced (StopRequest.agreed)."""

    def __init__(self, stop: StopRequest, checkpointer: Checkpointer, data: TrainData):
        self.request, self.checkpointer, self.data = stop, checkpointer, data
        self.record: dict | None = None
        """What the REQUEUE marker says, once the loop stopped early."""

    def on_train_start(self, run: RunInfo) -> None:
        pass

    def on_step_end(self, run: RunInfo, end: StepEnd) -> None:
        if not end.stopping or end.final:
            return
        grace = run.plan.config.train.preemption_grace_s
        save_s = end.slowest_save_s
        if not end.checkpointed and (save_s is None or end.signal_waited_s + save_s < grace):
            self.checkpointer.save(end.step, self.data.sampler.state_dict())
        elif not end.checkpointed and run.is_main:
            print(f"orchestrate: no checkpoint at step {end.step}: {end.signal_waited_s:.0f} s since the signal + "
                  f"{save_s:.0f} s to write one exceeds train.preemption_grace_s={grace}", flush=True)
        latest = latest_checkpoint(run.run_dir)
        self.record = {"step": read_meta(latest).step if latest else 0, "stopped_at": end.step,
                       "signal": self.request.signal_name, "checkpoint": str(latest) if latest else None}
        if run.is_main:
            write_requeue(run.run_dir, self.record)
            print(f"stopped by {self.request.signal_name or 'a signal'} after step {end.step}; resume from step "
                  f"{self.record['step']} ({run.run_dir / REQUEUE_FILE})", flush=True)
        end.stop = True

    def on_train_end(self, run: RunInfo, stopped_early: bool) -> None:
        pass
