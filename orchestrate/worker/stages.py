"""The stages of the worker's recipe (`orchestrate.worker.main.train`), each a small unit. Where a
training method does something of its own, the stage calls its runtime's hook
(orchestrate/methods/runtime.py): its auxiliary models, its model, its objective, its callbacks, its
saved files; its data comes as values (orchestrate/data/method_data.py: its own records or dataset)."""

from __future__ import annotations

import gc
import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from transformers.utils import logging as hf_logging

from orchestrate.backends.base import TrainEngine
from orchestrate.backends.rank import Rank
from orchestrate.backends.registry import get_backend
from orchestrate.backends.sequence_parallel import use_ulysses_attention
from orchestrate.config.schema import RunConfig
from orchestrate.config.section import MAX_COUNT
from orchestrate.data import build_data as build_token_data
from orchestrate.data.chat_template import saved_chat_template
from orchestrate.data.pipeline import TrainData
from orchestrate.data.tokenizer import save_tokenizer
from orchestrate.errors import Problem, UserError
from orchestrate.loading.init_weights import ensure_initial_weights
from orchestrate.loading.labels import write_labels
from orchestrate.loading.neftune import add_neftune
from orchestrate.loading.packed_attention import packing_notice
from orchestrate.methods.registry import active_methods, base_runtime, method_data, runtimes
from orchestrate.planner.plan import RunPlan
from orchestrate.run.checkpoints import checkpoint_root, newest_checkpoint
from orchestrate.run.layout import ADAPTER_DIR, MODEL_DIR, RunDir, check_no_links, clear_requeue
from orchestrate.run.lock import check_worker_may_run
from orchestrate.run.resume_rules import check_resumable
from orchestrate.run.writes import staged_dir
from orchestrate.worker.callbacks.base import Callback
from orchestrate.worker.callbacks.generate import EvalGenerate
from orchestrate.worker.callbacks.standard import Checkpoints, Evaluation, MetricsFile, Progress, StopOnSignal
from orchestrate.worker.callbacks.trackers import build_trackers
from orchestrate.worker.callbacks.verdict import MemoryVerdictPrinter
from orchestrate.worker.checkpointing import Checkpointer
from orchestrate.worker.objective import objective_for
from orchestrate.worker.preload import reads_weight_files
from orchestrate.worker.rank_start import start_rank

if TYPE_CHECKING:
    from orchestrate.worker.tensor_peak import TensorPeak


def read_plan(plan_path: Path) -> tuple[RunPlan, RunDir]:
    """The plan, with the library settings of its run section put in the environment (NCCL reads
    them at communicator creation, after this); the user's own values win."""
    plan_path = plan_path.resolve()
    plan = RunPlan.read(plan_path)  # a UserError for a plan without a feasible strategy
    for key, value in (plan.run.env if plan.run else {}).items():
        os.environ.setdefault(key, value)
    return plan, RunDir(plan_path.parent)


def check_run_dir(run: RunDir) -> None:
    """UserError when another launch holds the run directory's lock (orchestrate.run.lock), or when
    a symbolic link in it would take a write outside (workers started without this launcher too:
    launch.sh, srun, SSH)."""
    check_worker_may_run(run.path)
    check_no_links(run.path)


def start_process_group(plan: RunPlan) -> Rank:
    """This rank, in the process group the plan's backend asks for; the seed every rank starts from."""
    rank = start_rank(plan, get_backend(plan.strategy.backend).process_group(plan))
    torch.manual_seed(plan.config.train.seed)
    return rank


def checkpoint_to_resume(plan: RunPlan, run: RunDir, rank: Rank) -> Path | None:
    """The run's newest intact checkpoint, checked against the plan before anything is built (a
    mismatch fails fast); a starting worker also clears an old REQUEUE marker. Rank 0 verifies
    (checksums included) and tells the others, so every rank continues from the same one."""
    answer: list = [None, None]  # [checkpoint name, (headline, problems, details) of a UserError]
    if rank.is_main:
        try:
            found = newest_checkpoint(run.path, full=True)
            for line in found.notices():
                print(f"orchestrate: {line}", flush=True)
            answer = [found.chosen.path.name if found.chosen else None, None]
        except UserError as exc:
            answer = [None, (exc.headline, exc.problems, exc.details)]
    if dist.is_initialized() and rank.world_size > 1:
        dist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise UserError(*answer[1])
    resume_from = checkpoint_root(run.path) / answer[0] if answer[0] else None
    if resume_from is not None:
        check_resumable(resume_from, plan)
    if rank.is_main:
        clear_requeue(run.path)
    return resume_from


def build_data(plan: RunPlan, run: RunDir, rank: Rank) -> TrainData:
    """This rank's data: a method's own (your dataset factory), or the token pipeline's (maps the
    launcher's cache entry, or builds it on local rank 0; readers of the methods' own records)."""
    methods = method_data(plan.config)
    if methods.own is not None:
        return methods.own.train_data(plan, rank.rank, rank.world_size)
    sequence = (rank.sequence.index, rank.sequence.size) if rank.sequence else None
    return build_token_data(plan, run.path, rank.data_rank, rank.data_world_size, local_rank=rank.local_rank,
                            sequence=sequence, methods=methods)


def resolve_steps(plan: RunPlan, data: TrainData, resume_from: Path | None) -> RunPlan:
    """The plan with train.num_epochs as optimizer steps over this data (`TrainSection.resolved`): its
    training samples are the sampler's, the same on every rank and in every resume (a checkpoint of
    other data is refused), so every rank stops, decays the learning rate and checkpoints at the same
    step, as the launcher's prepare line said. The checkpoint to resume must lie within them."""
    train = plan.config.train
    if train.num_epochs is None:
        return plan
    resolved = train.resolved(data.sampler.num_blocks)
    if resolved.max_steps > MAX_COUNT:
        raise UserError("train.num_epochs gives too many steps", [Problem(
            "train.num_epochs", f"{resolved.length()} is more than {MAX_COUNT:,}", "lower train.num_epochs")])
    plan = plan.model_copy(update={"config": plan.config.model_copy(update={"train": resolved})})
    if resume_from is not None:
        check_resumable(resume_from, plan)
    return plan


def count_tensors(rank: Rank) -> TensorPeak | None:
    """On a CPU rank, the live CPU tensor bytes from here on (orchestrate/worker/tensor_peak.py: torch
    keeps no CPU allocator statistics); None on a GPU rank, whose peaks come from torch.cuda."""
    if rank.device.type != "cpu":
        return None
    from orchestrate.worker.tensor_peak import TensorPeak

    return TensorPeak.start()


def build_auxiliary(plan: RunPlan, run: RunDir, rank: Rank, data: TrainData) -> dict[str, Any]:
    """Every method's auxiliary models (distillation's teacher, at its placement; or its precomputed
    pass and cache), by method name. Before the trained model: a precomputing pass frees the auxiliary
    model first, and no ZeRO-3 HfDeepSpeedConfig may be alive while one is built (loading/auxiliary.py)."""
    built = {method.name: runtime.auxiliary(plan, rank, run, data)
             for method, runtime in zip(active_methods(plan.config), runtimes(plan.config), strict=True)}
    return {name: models for name, models in built.items() if models is not None}


def build_engine(plan: RunPlan, run: RunDir, rank: Rank, labels: list[str] | None,
                 auxiliary: dict[str, Any]) -> tuple[TrainEngine, Path]:
    """Initial weights -> the backend's model (built by the base method, with the methods' model
    transforms), wrapper, optimizer and schedule, training the objective of the task and the methods
    (with NEFTune's noise on its embeddings where train.neftune_noise_alpha asks, loading/neftune.py);
    returns the engine and the model directory it started from."""
    hf_logging.disable_progress_bar()  # "Writing model shards" bars would interleave across ranks
    backend = get_backend(plan.strategy.backend)
    model_dir = ensure_initial_weights(plan, run.path, rank.local_rank, labels, weights=reads_weight_files(plan))
    engine = backend.setup(plan, rank, model_dir, objective_for(plan, auxiliary, rank.sequence),
                           partial(base_runtime(plan.config).build_model, plan))
    if rank.sequence is not None:  # attention over the whole sequence: all-to-all over heads in the group
        use_ulysses_attention(engine.model, rank.sequence, plan.strategy.micro_batch_size)
    if (alpha := plan.config.train.neftune_noise_alpha) is not None:  # noised embeddings in training forwards
        add_neftune(engine.model, alpha, plan.config.train.seq_len)
    return engine, model_dir


def resume(plan: RunPlan, run: RunDir, rank: Rank, engine: TrainEngine, model_dir: Path, data: TrainData,
           resume_from: Path | None) -> tuple[Checkpointer, int]:
    """The engine, optimizer, schedule, scaler, RNG and sampler restored from `resume_from`;
    returns the checkpointer and the step to continue after."""
    # Dropout differs per rank (different data), reproducibly.
    torch.manual_seed(plan.config.train.seed + rank.rank)
    checkpointer = Checkpointer(plan, engine, rank, run.path, model_dir)
    if resume_from is None:
        return checkpointer, 0
    restored = checkpointer.load(resume_from)
    data.sampler.load_state_dict(restored["sampler"])
    return checkpointer, restored["step"]


def release_start_up_cache(rank: Rank) -> None:
    """Give the blocks cached while the model was built back to the driver before step 1, as
    torchtune's `cleanup_before_training` does (gc, then `empty_cache`). The caching allocator keeps
    freed blocks for later requests of its own sizes and streams, so what passed through the GPU while
    loading (FSDP2's broadcast from rank 0, quantization, ZeRO-3's partitioning, a checkpoint's
    shards) would otherwise stay reserved beside training's blocks: a reserved peak, and the
    calibration made from it, that the plan's training peak does not predict. The peak statistics are
    not reset (torchtune resets them): a start-up peak above training's is still one the card held."""
    if rank.device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def sample_noun(config: RunConfig) -> str:
    """What the run's training samples are, plural: records or data of a method's own as the method
    names them (`Method.record_noun`: preference pairs, GRPO prompts), else the token pipeline's
    blocks of seq_len (data.packing) or padded samples."""
    named = [noun for method in active_methods(config) if (noun := method.record_noun(config)) is not None]
    return named[0] if named else ("blocks" if config.data.packing else "samples")


def callbacks(plan: RunPlan, rank: Rank, data: TrainData, start_step: int, resume_from: Path | None) -> list[Callback]:
    """The built-in callbacks, the trackers of train.report_to and the methods' own; their phases
    order them (worker/callbacks/base.py): pruning, then evaluation (it adds eval_loss to the record
    the others see, and with train.eval_generate the generated answers), the observers, checkpoints,
    stop signals last."""
    tokens = plan.tokens_per_step
    intro = [f"training {plan.chosen.name} on {rank.world_size} rank(s): {plan.config.train.length()} of {tokens:,} "
             f"tokens ({data.train.shape[0]} train / {data.validation.shape[0]} validation {sample_noun(plan.config)})"]
    if resume_from is not None:
        intro.append(f"resumed from {resume_from} (step {start_step})")
    intro += [notice] if (notice := packing_notice(plan)) else []
    own = [callback for runtime in runtimes(plan.config) for callback in runtime.callbacks(plan)]
    return [*own, Evaluation(), EvalGenerate(), MetricsFile(), Progress(intro), *build_trackers(plan),
            MemoryVerdictPrinter(), Checkpoints(), StopOnSignal()]


def save_model(plan: RunPlan, run: RunDir, rank: Rank, engine: TrainEngine, data: TrainData) -> None:
    """What the methods save (collective): the base method the consolidated Hugging Face model, the
    add-ons what they change or add; then the tokenizer next to it. All of it is written into
    RUN_DIR/.tmp-save and moved into RUN_DIR/model (and adapter) once complete, so a link placed at
    either while the run trained is refused, not written through (`orchestrate.run.writes`)."""
    with staged_dir(run.path, (MODEL_DIR, ADAPTER_DIR), writer=rank.is_main) as staging:
        staged = RunDir(staging)  # its model and adapter are the staged ones
        lines = [line for runtime in runtimes(plan.config) for line in runtime.save(plan, engine, staged, rank)]
        if not rank.is_main:
            return
        if all(runtime.saves_tokenizer for runtime in runtimes(plan.config)):  # your own module has none
            # None: the byte tokenizer, as tokenizer.json; the YAML's chat template saved with it, and an
            # adapter a method saved gets the same tokenizer (PeftModel + AutoTokenizer from one directory).
            template, trust = saved_chat_template(plan.config), plan.config.model.trust_remote_code
            for out in (staged.model, *([staged.adapter] if staged.adapter.is_dir() else [])):
                save_tokenizer(data.tokenizer_dir, out, template, trust)
        if data.label_names is not None:
            write_labels(staged.model, data.label_names)
    lines = [line.replace(str(staged.path), str(run.path)) for line in lines]  # where it went once moved
    names = [*plan.files.backend, *([plan.files.accelerate_config] if plan.files.accelerate_config else [])]
    extra = "".join(f"      {line}\n" for line in lines)
    print(f"done. model:   {run.model}\n{extra}"
          f"      metrics: {run.metrics}\n"
          f"      configs: {run.path} (plan.json, config.yaml{''.join(f', {n}' for n in names)})\n"
          f"      logs:    {run.logs}", flush=True)
