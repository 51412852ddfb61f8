"""The step loop: one optimizer step, its record, the agreed stop flag, then every callback in phase order."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from orchestrate.worker.callbacks.base import Callback, StepEnd, Training, in_order
from orchestrate.worker.metrics import gather_step_stats
from orchestrate.worker.objective import loss_tokens
from orchestrate.worker.oom import StepOutOfMemory, host_out_of_memory

if TYPE_CHECKING:
    from orchestrate.backends.base import StepResult
    from orchestrate.planner.plan import RunPlan
    from orchestrate.worker.tensor_peak import TensorPeak


def counts_tokens(plan: RunPlan) -> bool:
    """Causal-LM batches carry per-token labels: the record says how many tokens carried loss (fewer than
    `tokens`, the positions trained on, where prompts, template tokens and padding are left out)."""
    model = plan.config.model
    return model.task == "causal-lm" and model.module is None


def step_record(training: Training, step: int, result: StepResult, step_time: float,
                stats: dict[str, Any]) -> dict[str, Any]:
    """The step's metrics.jsonl line from the `gather_step_stats` of every rank."""
    plan = training.plan
    tokens = plan.tokens_per_step
    counted = {"loss_tokens": stats["loss_tokens"], "loss_tokens_per_s": stats["loss_tokens"] / step_time} \
        if counts_tokens(plan) else {}
    return {"step": step, "loss": stats["loss"], "lr": result.lr, "grad_norm": result.grad_norm,
            "skipped": result.skipped, "tokens": tokens, "tokens_per_s": tokens / step_time, **counted,
            "step_time_s": step_time, "time": time.time(),
            **{k: v for k, v in stats.items() if k not in ("loss", "stop_max", "loss_tokens")},
            "predicted_gpu_bytes_per_rank": plan.chosen.memory.gpu_total,
            "predicted_cpu_bytes_per_node": plan.chosen.memory.cpu_total}


def run_loop(training: Training, callbacks: list[Callback], tensors: TensorPeak | None = None) -> bool:
    """Steps start_step+1 .. max_steps; returns True when a callback stopped the loop early. An
    out-of-memory error in a step, of the device or the host, is raised as StepOutOfMemory (the step,
    the engine's phase, which memory).
    `tensors`: the live-tensor counter of a CPU run, whose peak each step's record carries; it stops
    after its first steps (worker/tensor_peak.py) and at the end of the loop."""
    import torch

    plan, rank, engine, data = training.plan, training.rank, training.engine, training.data
    micro, accumulation = plan.strategy.micro_batch_size, plan.chosen.gradient_accumulation
    max_steps = plan.config.train.max_steps
    ordered = in_order(callbacks)
    for callback in ordered:
        callback.on_train_start(training)
    stopped = False
    try:
        for step in range(training.start_step + 1, max_steps + 1):
            start = time.perf_counter()
            batches = [data.micro_batch(micro) for _ in range(accumulation)]
            counted = sum(loss_tokens(b) for b in batches) if counts_tokens(plan) else 0
            try:
                result = engine.train_step([{k: v.to(rank.device, non_blocking=True) for k, v in b.items()}
                                            for b in batches])
                if rank.device.type == "cuda":
                    torch.cuda.synchronize(rank.device)
            except torch.OutOfMemoryError as error:
                raise StepOutOfMemory(step, getattr(engine, "phase", "step")) from error
            except (RuntimeError, MemoryError) as error:
                if not host_out_of_memory(error):
                    raise
                raise StepOutOfMemory(step, getattr(engine, "phase", "step"), "host") from error
            step_time = time.perf_counter() - start
            # One collective per step: the stats all-gather carries the stop flag too.
            stats = gather_step_stats(result.loss, rank.node, rank.device,
                                      training.stop.local(training.checkpointer.last_save_s), counted,
                                      tensors.peak if tensors is not None else None)
            record = step_record(training, step, result, step_time, stats)
            if tensors is not None:
                tensors.step_done()
            stopping, waited_s, save_s = training.stop.decide(*stats["stop_max"])
            end = StepEnd(step, step == max_steps, stopping, record, waited_s, save_s)
            for callback in ordered:
                callback.on_step_end(training, end)
            if end.stop:
                stopped = True
                break
    finally:
        if tensors is not None:
            tensors.stop()
        for callback in ordered:
            callback.on_train_end(training, stopped)
    return stopped
