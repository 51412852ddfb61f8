"""What `orchestrate launch CONFIG --resume` continues, and with which plan.

- The run: `--run-dir`, else the newest `<train.output_dir>/<name>-<timestamp>` holding a plan.json.
- The plan: the run's own plan.json when the config and the world size are unchanged, so the
  continuation is bit-identical to an uninterrupted run. Otherwise a new plan for this config and
  hardware, with the checkpoint's backend, ZeRO stage and precision pinned where the config leaves
  them "auto" (a new world size reshards: FSDP2 and DDP natively, DeepSpeed ZeRO through a
  universal checkpoint). The checkpoint keeps the plan that wrote it (step-N/plan.json).
- Either way the newest intact checkpoint (every step-* directory is verified against its
  manifest, newest first; damaged ones are named and skipped) is checked against the plan before
  any worker starts. The workers themselves resume from the newest intact checkpoint whenever
  there is one (worker/stages.py: checkpoint_to_resume), so they continue from the same one.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.backends.registry import get_backend
from orchestrate.errors import Problem, UserError
from orchestrate.model.meta import base_model_gone
from orchestrate.planner.plan import RunPlan
from orchestrate.planner.strategy import Strategy
from orchestrate.planning import feasible_plan
from orchestrate.run.checkpoints import (
    PLAN_COPY,
    CheckpointMeta,
    Discovery,
    list_checkpoints,
    newest_checkpoint,
)
from orchestrate.run.layout import PLAN_FILE
from orchestrate.run.resume_rules import check_resumable, config_changes

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig
    from orchestrate.hardware.profile import HardwareProfile

LOW_DISK_BYTES = 1 << 30
"""Below this much free space a failed run's notice mentions it even before the first checkpoint."""


def run_to_resume(config: RunConfig, name: str, run_dir: Path | None) -> Path:
    if run_dir is not None:
        run_dir = Path(run_dir).resolve()
        if not (run_dir / PLAN_FILE).is_file():
            raise UserError("nothing to resume", [Problem(
                "--run-dir", f"{run_dir} holds no {PLAN_FILE}", "give the run directory of an earlier `orchestrate launch`")])
        return run_dir
    base = config.output_root().resolve()
    # default_run_dir's names: <name>-YYYYmmdd-HHMMSS, then -2, -3, ... within the same second.
    pattern = re.compile(re.escape(name) + r"-(\d{8}-\d{6})(?:-(\d+))?")
    runs = []
    for path in base.glob(f"{name}-*"):
        m = pattern.fullmatch(path.name)
        if m and (path / PLAN_FILE).is_file():
            runs.append(((m.group(1), int(m.group(2) or 1)), path))
    if not runs:
        raise UserError("nothing to resume", [Problem(
            "--resume", f"no run of {name!r} in {base}",
            f"start one with `orchestrate launch {name}.yaml ...`, or give its directory with --run-dir")])
    return max(runs)[1]


def pinned_config(config: RunConfig, meta: CheckpointMeta) -> RunConfig:
    """`config` with what the checkpoint's optimizer state depends on fixed where it says "auto":
    the backend, the ZeRO stage where the backend cannot change it on resume, the precision."""
    config = config.model_copy(deep=True)
    saved = meta.strategy
    if config.strategy.backend == "auto":
        config.strategy.backend = saved["backend"]
    other_stage = {**saved, "zero_stage": -1}
    if (config.strategy.zero_stage == "auto" and config.strategy.backend == saved["backend"]
            and get_backend(saved["backend"]).resume_conflicts(saved, Strategy.from_dict(other_stage))):
        config.strategy.zero_stage = saved["zero_stage"]
    if config.train.precision == "auto":
        config.train.precision = saved["precision"]
    return config


def _same(a: RunConfig, b: RunConfig) -> bool:
    """The same training; train.output_dir (where new runs go, by default under the working
    directory) does not count."""
    def dump(c: RunConfig) -> dict:
        return c.model_copy(update={"train": c.train.model_copy(update={"output_dir": None})}).model_dump(mode="json")

    return dump(a) == dump(b)


def plan_for_resume(config: RunConfig, hardware: HardwareProfile, run_dir: Path) -> tuple[RunPlan, bool, Discovery,
                                                                                      list[str]]:
    """(plan, True when it is the run's own plan.json unchanged, the checkpoint it continues, the
    config changes since that checkpoint that apply from its next step). UserError when the newest
    intact checkpoint cannot continue under the plan or the changed config, or when the run has
    checkpoints but none is intact (starting from step 0 would replace them)."""
    old = RunPlan.read(run_dir / PLAN_FILE)
    base = config.model.name_or_path
    if base is not None and not config.resolve_path(base).exists() and (gone := base_model_gone(old.config, run_dir)):
        raise gone  # the local base moved and the config does not say where: not a Hub id to re-plan with
    found = newest_checkpoint(run_dir, full=True)
    ckpt = found.chosen.path if found.chosen else None
    unchanged = (old.hardware.nodes == hardware.nodes and old.world_size == hardware.world_size
                 and _same(old.config, config))
    if unchanged:
        plan = old
    else:
        plan = feasible_plan(pinned_config(config, found.chosen.meta) if ckpt else config, hardware)
    changes: list[str] = []
    if ckpt is not None:
        check_resumable(ckpt, plan)
        if (ckpt / PLAN_COPY).is_file():  # "auto" and the checkpoint's own choice are no change
            meta = found.chosen.meta
            changes, problems = config_changes(pinned_config(RunPlan.read(ckpt / PLAN_COPY).config, meta),
                                                pinned_config(config, meta))
            if problems:
                raise UserError(f"cannot resume from {ckpt}: the config changed where the checkpoint cannot "
                                "follow", problems)
    return plan, unchanged, found, changes


def resumed_data(run_dir: Path) -> tuple[str, dict] | None:
    """(the checkpoint the workers continue from, the data identity its sampler state recorded), for
    the launcher's data check (orchestrate/data/identity.py); None without a checkpoint or a record."""
    found = newest_checkpoint(run_dir, full=False)
    if found.chosen is None or found.chosen.meta.sampler.get("data") is None:
        return None
    return str(found.chosen.path), found.chosen.meta.sampler["data"]


def resume_notice(run_dir: Path, reused: bool, found: Discovery, changes: list[str]) -> str:
    if found.chosen is None:
        return f"resuming {run_dir}: no checkpoint yet, training starts from step 0"
    ckpt, meta = found.chosen.path, found.chosen.meta
    how = ("with its own plan" if reused else
           f"with a new plan (config or world size changed; the checkpoint's plan is {ckpt / PLAN_FILE})")
    lines = [*found.notices(), f"resuming {run_dir} from step {meta.step} ({meta.world_size} rank(s), "
             f"{meta.strategy_name}) {how}"]
    if changes:
        lines += [f"changed since the checkpoint, in effect from step {meta.step + 1}:",
                  *(f"  {change}" for change in changes)]
    return "\n".join(lines)


def refuse_checkpointed(run_dir: Path) -> None:
    """A new launch must not silently continue (or clobber) a run that has checkpoints, whatever
    `latest` says and whether or not they are intact."""
    ckpts = list_checkpoints(run_dir)
    if ckpts:
        raise UserError("the run directory already holds checkpoints", [Problem(
            "--run-dir", f"{run_dir} has the checkpoint(s) {', '.join(p.name for p in ckpts[-3:])}",
            "add --resume to continue that run, or choose another --run-dir")])


def failure_notice(run_dir: Path) -> str:
    """After the workers failed: which checkpoint a resume continues from, and the free space of
    the run directory's file system when it is low (on a full disk the workers' own message may
    not have reached their log files, which are on that disk)."""
    try:
        found = newest_checkpoint(run_dir, full=False)
    except UserError as exc:
        return f"no intact checkpoint in {run_dir}: {exc}"
    if found.chosen is None:
        text = f"no checkpoint in {run_dir} yet"
    else:
        text = f"the newest intact checkpoint is {found.chosen.path} (step {found.chosen.meta.step}): --resume continues from it"
    free = shutil.disk_usage(run_dir).free
    newest = found.chosen.path if found.chosen else None
    needed = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) if newest else 0
    if free < max(needed, LOW_DISK_BYTES):
        text += (f"; only {free / 2**20:,.0f} MiB are free on the file system of {run_dir}"
                 f"{f' (a checkpoint takes {needed / 2**20:,.0f} MiB)' if needed else ''}: "
                 "writes there fail with 'No space left on device'")
    return text
