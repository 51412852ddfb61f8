"""The stages of the worker's recipe (`orchestrate.worker.main.train`), each a small unit."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from orchestrate.backends.base import WorkerContext
from orchestrate.errors import UserError
from orchestrate.planner.plan import Plan
from orchestrate.run.checkpoints import checkpoint_root, newest_checkpoint
from orchestrate.run.layout import RunDir, clear_requeue
from orchestrate.run.resume_rules import check_resumable
from orchestrate.worker.callbacks.base import RunInfo, StepCallback

if TYPE_CHECKING:
    from orchestrate.backends.base import TrainEngine
    from orchestrate.data.pipeline import TrainData
    from orchestrate.methods.distill.objective import TeacherLogits
    from orchestrate.worker.checkpointing import Checkpointer
    from orchestrate.worker.dist_env import RankInfo
    from orchestrate.worker.signals import StopRequest
    from orchestrate.worker.tensor_peak import TensorPeak


@dataclass(frozen=True)
class Worker:
    """This process: its ranks, its device, its node."""

    ranks: RankInfo
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.ranks.rank == 0

    @property
    def node(self) -> int:
        return self.ranks.rank // max(1, self.ranks.local_world_size)


def read_plan(plan_path: Path) -> tuple[Plan, RunDir]:
    """The plan, with the library settings of its run section put in the environment (NCCL reads
    them at communicator creation, after this); the user's own values win."""
    plan_path = plan_path.resolve()
    plan = Plan.read(plan_path)
    if plan.chosen is None:
        raise UserError(f"{plan_path} has no feasible strategy to run; see `orchestrate plan`")
    for key, value in (plan.run.env if plan.run else {}).items():
        os.environ.setdefault(key, value)
    return plan, RunDir(plan_path.parent)


def check_run_dir(run: RunDir) -> None:
    """UserError when another launch holds the run directory's lock (orchestrate.run.lock), or when
    a symbolic link in it would take a write outside (workers started without this launcher too:
    launch.sh, srun, SSH)."""
    from orchestrate.run.layout import check_no_links
    from orchestrate.run.lock import check_worker_may_run

    check_worker_may_run(run.path)
    check_no_links(run.path)


def start_process_group(plan: Plan, run: RunDir) -> Worker:
    """The process group the plan's backend asks for; the seed every rank starts from."""
    from orchestrate.backends.registry import get_backend
    from orchestrate.worker.dist_env import init_distributed, rank_info

    ranks = rank_info()
    device = init_distributed(plan, ranks, get_backend(plan.chosen.strategy.backend).process_group(plan))
    torch.manual_seed(plan.config.train.seed)
    return Worker(ranks, device)


def checkpoint_to_resume(plan: Plan, run: RunDir, worker: Worker) -> Path | None:
    """The run's newest intact checkpoint, checked against the plan before anything is built (a
    mismatch fails fast); a starting worker also clears an old REQUEUE marker. Rank 0 verifies
    (checksums included) and tells the others, so every rank continues from the same one."""
    import torch.distributed as dist

    answer: list = [None, None]  # [checkpoint name, (headline, problems, details) of a UserError]
    if worker.is_main:
        try:
            found = newest_checkpoint(run.path, full=True)
            for line in found.notices():
                print(f"orchestrate: {line}", flush=True)
            answer = [found.chosen.path.name if found.chosen else None, None]
        except UserError as exc:
            answer = [None, (exc.headline, exc.problems, exc.details)]
    if dist.is_initialized() and worker.ranks.world_size > 1:
        dist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise UserError(*answer[1])
    resume_from = checkpoint_root(run.path) / answer[0] if answer[0] else None
    if resume_from is not None:
        check_resumable(resume_from, plan)
    if worker.is_main:
        clear_requeue(run.path)
    return resume_from


def build_data(plan: Plan, run: RunDir, worker: Worker) -> TrainData:
    """This rank's data (maps the launcher's cache entry, or builds it on local rank 0)."""
    from orchestrate.data import build_data as build

    ranks = worker.ranks
    if plan.config.data.module is not None:  # your own dataset factory (orchestrate.methods.custom.data)
        from orchestrate.methods.custom.train_data import build_module_data

        return build_module_data(plan, ranks.rank, ranks.world_size)
    return build(plan, run.path, ranks.rank, ranks.world_size, local_rank=ranks.local_rank)


def count_tensors(worker: Worker) -> TensorPeak | None:
    """On a CPU rank, the live CPU tensor bytes from here on (orchestrate/worker/tensor_peak.py: torch
    keeps no CPU allocator statistics); None on a GPU rank, whose peaks come from torch.cuda."""
    if worker.device.type != "cpu":
        return None
    from orchestrate.worker.tensor_peak import TensorPeak

    return TensorPeak.start()


def build_teacher(plan: Plan, run: RunDir, worker: Worker, data: TrainData) -> TeacherLogits | None:
    """distill: the frozen teacher where the plan places it (orchestrate/methods/distill/build.py), or,
    precomputed, the first pass into RUN_DIR/teacher_cache and its reader. Before the student."""
    if plan.config.distill is None:
        return None
    from orchestrate.methods.distill.build import build_teacher as build
    from orchestrate.methods.distill.build import teacher_placement
    from orchestrate.methods.distill.cache import TeacherCache, write_cache
    from orchestrate.methods.distill.objective import live_teacher

    world = worker.ranks.world_size
    placement = teacher_placement(plan, worker.device, world)
    if placement != "precomputed":
        return live_teacher(build(plan, worker.device, world, placement))
    # The first pass holds as little of the teacher per device as there is: its shards offloaded
    # to the CPU (GPUs), or sharded over the ranks.
    lean = "offload" if worker.device.type == "cuda" else "sharded" if world > 1 else "replicated"
    teacher = build(plan, worker.device, world, lean)
    write_cache(plan, run.path, data, teacher, worker.device, worker.ranks.rank, world)
    del teacher  # freed before the student is built: the point of precomputing
    return TeacherCache(run.path, data)


def build_engine(plan: Plan, run: RunDir, worker: Worker, labels: list[str] | None,
                 teacher: TeacherLogits | None = None) -> tuple[TrainEngine, WorkerContext]:
    """Initial weights -> the backend's model (with the plan's model transforms), wrapper,
    optimizer and schedule, training the task's objective (distilled from `teacher` with `distill:`)."""
    from transformers.utils import logging as hf_logging

    from orchestrate.backends.registry import get_backend
    from orchestrate.loading.init_weights import ensure_initial_weights
    from orchestrate.worker.objective import objective_for

    hf_logging.disable_progress_bar()  # "Writing model shards" bars would interleave across ranks
    ranks, backend = worker.ranks, get_backend(plan.chosen.strategy.backend)
    model_dir = ensure_initial_weights(plan, run.path, ranks.local_rank, labels, weights=backend.reads_weights(plan))
    ctx = WorkerContext(rank=ranks.rank, local_rank=ranks.local_rank, world_size=ranks.world_size,
                        device=worker.device, run_dir=run.path, model_dir=model_dir, objective=objective_for(plan, teacher))
    return backend.setup(plan, ctx), ctx


def resume(plan: Plan, ctx: WorkerContext, engine: TrainEngine, data: TrainData,
           resume_from: Path | None) -> tuple[Checkpointer, int]:
    """The engine, optimizer, schedule, scaler, RNG and sampler restored from `resume_from`;
    returns the checkpointer and the step to continue after."""
    from orchestrate.worker.checkpointing import Checkpointer

    # Dropout differs per rank (different data), reproducibly.
    torch.manual_seed(plan.config.train.seed + ctx.rank)
    checkpointer = Checkpointer(plan, engine, ctx)
    if resume_from is None:
        return checkpointer, 0
    restored = checkpointer.load(resume_from)
    data.sampler.load_state_dict(restored["sampler"])
    return checkpointer, restored["step"]


def run_info(plan: Plan, run: RunDir, worker: Worker, start_step: int) -> RunInfo:
    return RunInfo(plan=plan, run_dir=run.path, rank=worker.ranks.rank, world_size=worker.ranks.world_size,
                   start_step=start_step)


def callbacks(info: RunInfo, engine: TrainEngine, data: TrainData, stop: StopRequest, checkpointer: Checkpointer,
              worker: Worker, resume_from: Path | None) -> list[StepCallback]:
    """Pruning (with `prune:`: everything after sees the pruned weights), then evaluation (it adds
    eval_loss to the record the others see), then the observers (metrics file, progress, the trackers
    of train.report_to, the memory verdict), checkpoints, stop signals last."""
    from orchestrate.methods.prune.callback import Pruning
    from orchestrate.worker.callbacks.standard import (
        Checkpoints,
        Evaluation,
        MetricsFile,
        Progress,
        StopOnSignal,
    )
    from orchestrate.worker.callbacks.trackers import build_trackers
    from orchestrate.worker.callbacks.verdict import MemoryVerdictPrinter

    plan, chosen = info.plan, info.plan.chosen
    tokens = chosen.strategy.micro_batch_size * chosen.gradient_accumulation * info.world_size * plan.config.train.seq_len
    intro = [f"training {chosen.name} on {info.world_size} rank(s): {plan.config.train.max_steps} steps "
             f"of {tokens:,} tokens ({data.train.shape[0]} train / {data.validation.shape[0]} validation blocks)"]
    if resume_from is not None:
        intro.append(f"resumed from {resume_from} (step {info.start_step})")
    pruning = [Pruning(engine)] if plan.config.prune is not None else []
    return [*pruning, Evaluation(engine, data, worker.device), MetricsFile(RunDir(info.run_dir).metrics), Progress(intro),
            *build_trackers(plan), MemoryVerdictPrinter(), Checkpoints(checkpointer, data),
            StopOnSignal(stop, checkpointer, data)]


def save_model(plan: Plan, run: RunDir, engine: TrainEngine, data: TrainData, worker: Worker) -> None:
    """The consolidated Hugging Face model (collective), with the tokenizer next to it."""
    from orchestrate.data.tokenizer import save_tokenizer

    engine.save_hf_model(run.model)
    prune = plan.config.prune
    if prune is not None and prune.method == "structured" and worker.is_main:  # physically smaller
        from orchestrate.methods.prune.schedule import pruned_channels, pruned_heads
        from orchestrate.methods.prune.shrink import Cut, shrink_saved_model

        shape = plan.shape
        shrink_saved_model(run.model, Cut(pruned_channels(shape, prune), pruned_heads(shape, prune),
                                          shape.num_kv_heads, shape.head_dim))
    if plan.config.train.method != "full":  # the planner keeps these on backends whose engine saves adapters
        engine.save_adapter(run.adapter)
    if not worker.is_main:
        return
    if plan.config.model.module is None:  # your own module has no tokenizer
        # None: the byte tokenizer, as tokenizer.json
        save_tokenizer(data.tokenizer_dir, run.model, plan.config.model.trust_remote_code)
    if data.label_names is not None:
        from orchestrate.loading.labels import write_labels

        write_labels(run.model, data.label_names)
    names = [v for k, v in plan.files.items() if k.startswith("backend") or k == "accelerate_config"]
    adapter = f"      adapter: {run.adapter}\n" if plan.config.train.method != "full" else ""
    print(f"done. model:   {run.model}\n{adapter}"
          f"      metrics: {run.metrics}\n"
          f"      configs: {run.path} (plan.json, config.yaml{''.join(f', {n}' for n in names)})\n"
          f"      logs:    {run.logs}", flush=True)
