"""The worker's whole life: plan -> process group -> initial weights -> backend engine -> data ->
(resume from the run's latest checkpoint) -> optimizer steps up to `max_steps` with metrics,
evaluation and checkpoints -> consolidated Hugging Face model.

Fault tolerance (docs/fault-tolerance.md): whenever RUN_DIR/checkpoints/latest names a complete
checkpoint the worker continues from it, so `orchestrate launch --resume`, a torchrun restart
(`--max-restarts`) and a SLURM requeue all resume the same way. SIGTERM/SIGUSR1 make every rank
finish the step, checkpoint at the same step and exit EX_TEMPFAIL (75) with RUN_DIR/REQUEUE.

Everything comes from plan.json (the launcher's only channel); the environment supplies only
torchrun's rank variables and the library settings recorded in the plan's run section (NCCL).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from orchestrate.errors import EXIT_USER_ERROR, UserError
from orchestrate.launch.slurm import EX_TEMPFAIL
from orchestrate.planner.plan import Plan

MODEL_OUT_DIR = "model"


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def train(plan_path: Path) -> int:
    """Run the plan on this rank; returns the exit status: 0 when done, EX_TEMPFAIL when a signal
    stopped it early (RUN_DIR/REQUEUE says from which checkpoint to resume). Collective."""
    import torch.distributed as dist

    from orchestrate.backends.base import WorkerContext, get_backend
    from orchestrate.data import build_data
    from orchestrate.launch.rundir import read_run_info
    from orchestrate.model.init_weights import ensure_initial_weights
    from orchestrate.worker.checkpointing import Checkpointer, check_resumable, latest_checkpoint
    from orchestrate.worker.dist_env import init_distributed, rank_info
    from orchestrate.worker.metrics import METRICS_FILE, MetricsWriter, gather_step_stats, mean_over_ranks
    from orchestrate.worker.progress import ProgressDisplay
    from orchestrate.worker.signals import StopRequest, clear_requeue

    plan_path = plan_path.resolve()
    run_dir = plan_path.parent
    plan = Plan.read(plan_path)
    if plan.chosen is None:
        raise UserError(f"{plan_path} has no feasible strategy to run; see `orchestrate plan`")
    for key, value in read_run_info(plan_path).get("env", {}).items():
        os.environ.setdefault(key, value)  # NCCL reads these at communicator creation, after this

    stop = StopRequest().install()  # from here on SIGTERM/SIGUSR1 mean "checkpoint and exit"
    info = rank_info()
    device = init_distributed(plan, info)
    is_main = info.rank == 0
    train_cfg = plan.config.train
    resume_from = latest_checkpoint(run_dir)
    if resume_from is not None:
        check_resumable(resume_from, plan)  # before building anything: a mismatch fails fast
    if is_main:
        clear_requeue(run_dir)
    torch.manual_seed(train_cfg.seed)

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" bars would interleave across ranks
    model_dir = ensure_initial_weights(plan, run_dir, info.local_rank)
    ctx = WorkerContext(rank=info.rank, local_rank=info.local_rank, world_size=info.world_size,
                        device=device, run_dir=run_dir, model_dir=model_dir)
    engine = get_backend(plan.chosen.strategy.backend).setup(plan, ctx)
    data = build_data(plan, run_dir, info.rank, info.world_size, local_rank=info.local_rank)
    # Dropout differs per rank (different data), reproducibly.
    torch.manual_seed(train_cfg.seed + info.rank)
    checkpointer = Checkpointer(plan, engine, ctx)
    start_step = 0
    if resume_from is not None:
        restored = checkpointer.load(resume_from)  # engine, optimizer, schedule, scaler, RNG
        data.sampler.load_state_dict(restored["sampler"])
        start_step = restored["step"]

    micro, accumulation = plan.chosen.strategy.micro_batch_size, plan.chosen.gradient_accumulation
    tokens_per_step = micro * accumulation * info.world_size * train_cfg.seq_len
    node = info.rank // max(1, info.local_world_size)
    predicted = {"predicted_gpu_bytes_per_rank": plan.chosen.memory.gpu_total,
                 "predicted_cpu_bytes_per_node": plan.chosen.memory.cpu_total}
    eval_batches = [_to_device(b, device) for b in
                    data.eval_batches(micro, train_cfg.eval_batches, info.rank, info.world_size)]
    writer = MetricsWriter(run_dir / METRICS_FILE, resume_step=start_step) if is_main else None
    progress = ProgressDisplay(train_cfg.max_steps, enabled=is_main)
    callbacks, run_info = _observers(plan, run_dir, info, start_step)  # trackers-branch hook
    if is_main:
        progress.message(f"training {plan.chosen.name} on {info.world_size} rank(s): {train_cfg.max_steps} steps "
                         f"of {tokens_per_step:,} tokens ({data.train.shape[0]} train / "
                         f"{data.validation.shape[0]} validation blocks)")
        if resume_from is not None:
            progress.message(f"resumed from {resume_from} (step {start_step})")
    stopped = None
    try:
        for step in range(start_step + 1, train_cfg.max_steps + 1):
            start = time.perf_counter()
            batches = [_to_device(data.micro_batch(micro), device) for _ in range(accumulation)]
            result = engine.train_step(batches)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_time = time.perf_counter() - start
            stats = gather_step_stats(result.loss, node, device)
            final = step == train_cfg.max_steps
            stopping, waited_s, save_s = stop.agreed(device, checkpointer.last_save_s)
            eval_loss = None
            if eval_batches and not (stopping and not final) and (
                    (train_cfg.eval_every and step % train_cfg.eval_every == 0) or final):
                local = sum(engine.eval_loss(b) for b in eval_batches) / len(eval_batches)
                eval_loss = mean_over_ranks(local, device)
            if writer is not None:
                record = {"step": step, "loss": stats["loss"], "lr": result.lr, "grad_norm": result.grad_norm,
                          "skipped": result.skipped, "tokens": tokens_per_step,
                          "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
                          "time": time.time(), **{k: v for k, v in stats.items() if k != "loss"}, **predicted}
                if eval_loss is not None:
                    record["eval_loss"] = eval_loss
                writer.write(record)
                for cb in callbacks:
                    cb.on_step_end(run_info, record)
            progress.update(step, stats["loss"], tokens_per_step / step_time, eval_loss)
            periodic = bool(train_cfg.checkpoint_every) and step % train_cfg.checkpoint_every == 0
            if periodic or final:
                checkpointer.save(step, data.sampler.state_dict())
            if stopping and not final:
                stopped = _stop_early(checkpointer, data, step, periodic, waited_s, save_s, stop, run_dir)
                break
    finally:
        progress.close()
        if writer is not None:
            writer.close()
        for cb in callbacks:
            cb.on_train_end(run_info, stopped is not None)

    if stopped is not None:
        if is_main:
            print(f"stopped by {stop.signal_name or 'a signal'} after step {stopped['stopped_at']}; "
                  f"resume from step {stopped['step']} ({run_dir / 'REQUEUE'})", flush=True)
        dist.barrier()
        dist.destroy_process_group()
        return EX_TEMPFAIL

    engine.save_hf_model(run_dir / MODEL_OUT_DIR)
    if is_main:
        if data.tokenizer_dir is not None:
            _copy_tokenizer(data.tokenizer_dir, run_dir / MODEL_OUT_DIR)
        print(f"done. model:   {run_dir / MODEL_OUT_DIR}\n"
              f"      metrics: {run_dir / METRICS_FILE}\n"
              f"      configs: {run_dir} (plan.json, config.yaml{_rendered(plan)})\n"
              f"      logs:    {run_dir / 'logs'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _stop_early(checkpointer, data, step: int, saved: bool, waited_s: float, save_s: float | None,
                stop, run_dir: Path) -> dict:
    """Checkpoint (unless this step has one, or the grace period would run out while writing it)
    and leave the REQUEUE marker. Every rank decides alike: the inputs were all-reduced."""
    from orchestrate.worker.checkpointing import latest_checkpoint, read_meta
    from orchestrate.worker.signals import write_requeue

    grace = checkpointer.plan.config.train.preemption_grace_s
    if not saved and (save_s is None or waited_s + save_s < grace):
        checkpointer.save(step, data.sampler.state_dict())
    elif not saved and checkpointer.ctx.rank == 0:
        print(f"orchestrate: no checkpoint at step {step}: {waited_s:.0f} s since the signal + {save_s:.0f} s "
              f"to write one exceeds train.preemption_grace_s={grace}", flush=True)
    latest = latest_checkpoint(run_dir)
    record = {"step": read_meta(latest)["step"] if latest else 0, "stopped_at": step,
              "signal": stop.signal_name, "checkpoint": str(latest) if latest else None}
    if checkpointer.ctx.rank == 0:
        write_requeue(run_dir, record)
    return record


def _observers(plan: Plan, run_dir: Path, info, start_step: int):
    """The trackers of train.report_to and the memory verdict, started; until the step loop calls
    callbacks itself (orchestrate/worker/callbacks.py)."""
    from orchestrate.worker.callbacks import RunInfo
    from orchestrate.worker.trackers import build_trackers
    from orchestrate.worker.verdict_callback import MemoryVerdictPrinter

    run = RunInfo(plan=plan, run_dir=run_dir, rank=info.rank, world_size=info.world_size, start_step=start_step)
    callbacks = [*build_trackers(plan), MemoryVerdictPrinter()]
    for cb in callbacks:
        cb.on_train_start(run)
    return callbacks, run


def _rendered(plan: Plan) -> str:
    names = [v for k, v in plan.files.items() if k.startswith("backend") or k == "accelerate_config"]
    return "".join(f", {n}" for n in names)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    """Keep a trained model usable as is: its tokenizer files go next to the weights."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(dst))


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    parser = argparse.ArgumentParser(prog="python -m orchestrate.worker",
                                     description="Train one rank of an orchestrate plan.")
    parser.add_argument("plan", type=Path, help="RUN_DIR/plan.json written by `orchestrate launch` or `config`")
    args = parser.parse_args(argv)
    if not args.plan.is_file():
        print(f"error: plan file {args.plan} not found", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        # @record writes the traceback of an unexpected error to torchrun's per-rank error file.
        return record(train)(args.plan)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
