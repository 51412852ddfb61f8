"""The step loop: one optimizer step, its record, the agreed stop flag, then every callback."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from orchestrate.worker.callbacks.base import RunInfo, StepCallback, StepEnd
from orchestrate.worker.metrics import gather_step_stats

if TYPE_CHECKING:
    import torch

    from orchestrate.backends.base import StepResult, TrainEngine
    from orchestrate.data.pipeline import TrainData
    from orchestrate.worker.checkpointing import Checkpointer
    from orchestrate.worker.signals import StopRequest
    from orchestrate.worker.tensor_peak import TensorPeak


def step_record(run: RunInfo, step: int, result: StepResult, step_time: float,
                stats: dict[str, Any]) -> dict[str, Any]:
    """The step's metrics.jsonl line from the `gather_step_stats` of every rank."""
    chosen = run.plan.chosen
    tokens = (chosen.strategy.micro_batch_size * chosen.gradient_accumulation * run.world_size
              * run.plan.config.train.seq_len)
    return {"step": step, "loss": stats["loss"], "lr": result.lr, "grad_norm": result.grad_norm,
            "skipped": result.skipped, "tokens": tokens, "tokens_per_s": tokens / step_time,
            "step_time_s": step_time, "time": time.time(),
            **{k: v for k, v in stats.items() if k not in ("loss", "stop_max")},
            "predicted_gpu_bytes_per_rank": chosen.memory.gpu_total,
            "predicted_cpu_bytes_per_node": chosen.memory.cpu_total}


def run_loop(run: RunInfo, engine: TrainEngine, data: TrainData, stop: StopRequest, checkpointer: Checkpointer,
             callbacks: list[StepCallback], node: int, device: torch.device, tensors: TensorPeak | None = None) -> bool:
    """Steps start_step+1 .. max_steps; returns True when a callback stopped the loop early.
    `tensors`: the live-tensor counter of a CPU run, whose peak each step's record carries; it stops
    after its first steps (worker/tensor_peak.py) and at the end of the loop."""
    import torch

    micro = run.plan.chosen.strategy.micro_batch_size
    accumulation = run.plan.chosen.gradient_accumulation
    max_steps = run.plan.config.train.max_steps
    for callback in callbacks:
        callback.on_train_start(run)
    stopped = False
    try:
        for step in range(run.start_step + 1, max_steps + 1):
            start = time.perf_counter()
            result = engine.train_step([{k: v.to(device, non_blocking=True) for k, v in data.micro_batch(micro).items()}
                                        for _ in range(accumulation)])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_time = time.perf_counter() - start
            # One collective per step: the stats all-gather carries the stop flag too.
            stats = gather_step_stats(result.loss, node, device, stop.local(checkpointer.last_save_s),
                                      tensors.peak if tensors is not None else None)
            record = step_record(run, step, result, step_time, stats)
            if tensors is not None:
                tensors.step_done()
            stopping, waited_s, save_s = stop.decide(*stats["stop_max"])
            end = StepEnd(step, step == max_steps, stopping, record, waited_s, save_s)
            for callback in callbacks:
                callback.on_step_end(run, end)
            if end.stop:
                stopped = True
                break
    finally:
        if tensors is not None:
            tensors.stop()
        for callback in callbacks:
            callback.on_train_end(run, stopped)
    return stopped
