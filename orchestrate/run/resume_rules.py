"""What must match for a checkpoint to continue under a plan: checked by the launcher before any
worker starts (`--resume`) and by every worker before it builds anything."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.backends.registry import get_backend
from orchestrate.errors import Problem, UserError
from orchestrate.run.checkpoints import FORMAT_VERSION, CheckpointMeta, read_meta

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig
    from orchestrate.planner.plan import RunPlan

EXPORT_FIX = ("or `orchestrate export RUN_DIR --out DIR` and start a new run from it "
              "(model.name_or_path: DIR)")


def resume_problems(meta: CheckpointMeta, plan: RunPlan) -> list[Problem]:
    """Why the checkpoint described by `meta` cannot continue under `plan` (empty: it can). World
    size may differ where the backend reshards (each backend's `resume_conflicts` says what not)."""
    problems = []
    if meta.format != FORMAT_VERSION:
        problems.append(Problem("checkpoint", f"format {meta.format} is not this version's {FORMAT_VERSION}",
                                "resume it with the orchestrate version that wrote it"))
    shape = plan.shape.to_dict()
    diff = [f"{k} {meta.model_shape.get(k)} -> {v}" for k, v in shape.items() if meta.model_shape.get(k) != v]
    if diff:
        problems.append(Problem("model", "the model differs from the checkpoint's: " + ", ".join(diff),
                                "resume with the model the checkpoint was trained with"))
    strategy, saved = plan.strategy, meta.strategy
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
    if train.num_epochs is not None and train.max_steps is not None and meta.step > train.max_steps:
        problems.append(Problem("train.num_epochs", f"{train.length()} end before the checkpoint's step {meta.step}",
                                "raise train.num_epochs, or export that checkpoint"))
    elif train.max_steps is not None and meta.step > train.max_steps:  # num_epochs: once the worker resolved it
        problems.append(Problem("train.max_steps", f"{train.max_steps} is before the checkpoint's step {meta.step}",
                                f"set train.max_steps to at least {meta.step}, or export that checkpoint"))
    for key, then, now in (("seq_len", meta.seq_len, train.seq_len),
                           ("global_batch_size", meta.global_batch_size, train.global_batch_size)):
        if then != now:
            problems.append(Problem(f"train.{key}", f"the checkpoint used {then}, this plan {now}: the data "
                                    "position and step count would mean something else",
                                    f"set train.{key}: {then}, {EXPORT_FIX}"))
    return problems


REFUSED_CHANGES = {
    "model.": "the checkpoint holds that model's weights",
    "train.method": "the checkpoint holds that method's weights",
    "train.lora.": "the checkpoint's adapters were made with those settings",
    "train.quantization.": "the checkpoint's adapters were trained on that quantized base",
    "train.optimizer.name": "the checkpoint's optimizer state is that optimizer's",
    "train.seed": "the data order and the random states continue from the checkpoint's",
    "prune.": "the checkpoint's masks follow that pruning schedule",
    "distill.": "the checkpoint trained against that teacher",
    "preference.": "the checkpoint trained on that preference loss against that reference",
}
"""Config changes a checkpoint cannot continue under (what `resume_problems` checks aside). Every other
change under train. and strategy. applies from the next step: the optimizer settings and schedule
after the state is loaded (backends/schedule.py `apply_hyperparameters`), the rest through the plan."""
NOT_COMPARED = ("data.", "train.output_dir")
"""The data is checked by its identity (orchestrate/data/identity.py), before the workers start;
train.output_dir says where new runs go, not how this one trains."""


def _leaves(data: object, path: str = "") -> dict[str, object]:
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in _leaves(value, f"{path}{key}.").items()}
    return {path.rstrip("."): data}


def config_changes(then: RunConfig, now: RunConfig) -> tuple[list[str], list[Problem]]:
    """(each change that applies from the next step, as "path: old -> new"; a Problem for each change the
    checkpoint of `then` cannot continue under, with its YAML path)."""
    old, new = _leaves(then.model_dump(mode="json")), _leaves(now.model_dump(mode="json"))
    applied, problems = [], []
    for path in sorted(old.keys() | new.keys()):
        before, after = old.get(path), new.get(path)
        if before == after or path.startswith(NOT_COMPARED):
            continue
        why = next((reason for prefix, reason in REFUSED_CHANGES.items() if path.startswith(prefix)), None)
        if why is None:
            applied.append(f"{path}: {before} -> {after}")
        else:
            problems.append(Problem(path, f"{before} when the checkpoint was written, {after} now: {why}",
                                    f"set {path}: {before} to resume, {EXPORT_FIX}"))
    return applied, problems


def check_resumable(ckpt_dir: Path, plan: RunPlan) -> CheckpointMeta:
    """The checkpoint's metadata; UserError naming every difference that prevents resuming."""
    meta = read_meta(ckpt_dir)
    problems = resume_problems(meta, plan)
    if problems:
        raise UserError(f"cannot resume from {ckpt_dir}", problems)
    return meta
