"""What must match for a checkpoint to continue under a plan: checked by the launcher before any
worker starts (`--resume`) and by every worker before it builds anything."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.errors import Problem, UserError
from orchestrate.run.checkpoints import FORMAT_VERSION, CheckpointMeta, read_meta

if TYPE_CHECKING:
    from orchestrate.planner.plan import RunPlan

EXPORT_FIX = ("or `orchestrate export RUN_DIR --out DIR` and start a new run from it "
              "(model.name_or_path: DIR)")


def resume_problems(meta: CheckpointMeta, plan: RunPlan) -> list[Problem]:
    """Why the checkpoint described by `meta` cannot continue under `plan` (empty: it can). World
    size may differ where the backend reshards (each backend's `resume_conflicts` says what not)."""
    from orchestrate.backends.registry import get_backend

    problems = []
    if meta.format != FORMAT_VERSION:
        problems.append(Problem("checkpoint", f"format {meta.format} is not this version's {FORMAT_VERSION}",
                                "resume it with the orchestrate version that wrote it"))
    shape = plan.shape.to_dict()
    diff = [f"{k} {meta.model_shape.get(k)} -> {v}" for k, v in shape.items() if meta.model_shape.get(k) != v]
    if diff:
        problems.append(Problem("model", "the model differs from the checkpoint's: " + ", ".join(diff),
                                "resume with the model the checkpoint was trained with"))
    strategy, saved = plan.chosen.strategy, meta.strategy
    if saved["backend"] != strategy.backend:
        problems.append(Problem("strategy.backend", f"the checkpoint was written by {saved['backend']}, this plan "
                                f"uses {strategy.backend}; optimizer states do not convert across backends",
                                f"set strategy.backend: {saved['backend']}, {EXPORT_FIX}"))
    else:
        problems += get_backend(strategy.backend).resume_conflicts(saved, strategy)
    if saved["precision"] != strategy.precision:
        problems.append(Problem("train.precision", f"the checkpoint trained in {saved['precision']}, this plan in "
                                f"{strategy.precision}", f"set train.precision: {saved['precision']}, {EXPORT_FIX}"))
    train = plan.config.train
    if meta.step > train.max_steps:
        problems.append(Problem("train.max_steps", f"{train.max_steps} is before the checkpoint's step {meta.step}",
                                f"set train.max_steps to at least {meta.step}, or export that checkpoint"))
    for key, then, now in (("seq_len", meta.seq_len, train.seq_len),
                           ("global_batch_size", meta.global_batch_size, train.global_batch_size)):
        if then != now:
            problems.append(Problem(f"train.{key}", f"the checkpoint used {then}, this plan {now}: the data "
                                    "position and step count would mean something else",
                                    f"set train.{key}: {then}, {EXPORT_FIX}"))
    return problems


def check_resumable(ckpt_dir: Path, plan: RunPlan) -> CheckpointMeta:
    """The checkpoint's metadata; UserError naming every difference that prevents resuming."""
    meta = read_meta(ckpt_dir)
    problems = resume_problems(meta, plan)
    if problems:
        raise UserError(f"cannot resume from {ckpt_dir}", problems)
    return meta
