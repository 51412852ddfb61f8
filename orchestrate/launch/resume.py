"""What `orchestrate launch CONFIG --resume` continues, and with which plan.

- The run: `--run-dir`, else the newest `<train.output_dir>/<name>-<timestamp>` holding a plan.json.
- The plan: the run's own plan.json when the config and the world size are unchanged, so the
  continuation is bit-identical to an uninterrupted run. Otherwise a new plan for this config and
  hardware, with the checkpoint's backend, ZeRO stage and precision pinned where the config leaves
  them "auto" (a new world size reshards: FSDP2 and DDP natively, DeepSpeed ZeRO through a
  universal checkpoint). The checkpoint keeps the plan that wrote it (step-N/plan.json).
- Either way the latest checkpoint is checked against the plan before any worker starts. The
  workers themselves resume from RUN_DIR/checkpoints/latest whenever it exists (worker/main.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.errors import Problem, UserError
from orchestrate.planner.plan import Plan
from orchestrate.run.checkpoints import CheckpointMeta, latest_checkpoint, read_meta
from orchestrate.run.layout import PLAN_FILE
from orchestrate.run.resume_rules import check_resumable

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig
    from orchestrate.hardware.profile import HardwareProfile


def run_to_resume(config: RunConfig, name: str, run_dir: Path | None) -> Path:
    if run_dir is not None:
        run_dir = Path(run_dir).resolve()
        if not (run_dir / PLAN_FILE).is_file():
            raise UserError("nothing to resume", [Problem(
                "--run-dir", f"{run_dir} holds no {PLAN_FILE}", "give the run directory of an earlier `orchestrate launch`")])
        return run_dir
    base = config.resolve_path(config.train.output_dir).resolve()
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


def _pinned(config: RunConfig, meta: CheckpointMeta) -> RunConfig:
    """`config` with what the checkpoint's optimizer state depends on fixed where it says "auto":
    the backend, the ZeRO stage where the backend cannot change it on resume, the precision."""
    from orchestrate.backends.registry import get_backend
    from orchestrate.planner.strategy import Strategy

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


def plan_for_resume(config: RunConfig, hardware: HardwareProfile, run_dir: Path) -> tuple[Plan, bool]:
    """(plan, True when it is the run's own plan.json unchanged). UserError when the latest
    checkpoint cannot continue under it."""
    from orchestrate.planning import feasible_plan

    old = Plan.read(run_dir / PLAN_FILE)
    ckpt = latest_checkpoint(run_dir)
    unchanged = (old.chosen is not None and old.hardware.nodes == hardware.nodes
                 and old.world_size == hardware.world_size
                 and old.config.model_dump(mode="json") == config.model_dump(mode="json"))
    if unchanged:
        plan = old
    else:
        plan = feasible_plan(_pinned(config, read_meta(ckpt)) if ckpt else config, hardware)
    if ckpt is not None:
        check_resumable(ckpt, plan)
    return plan, unchanged


def resume_notice(run_dir: Path, reused: bool) -> str:
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return f"resuming {run_dir}: no checkpoint yet, training starts from step 0"
    meta = read_meta(ckpt)
    how = ("with its own plan" if reused else
           f"with a new plan (config or world size changed; the checkpoint's plan is {ckpt / PLAN_FILE})")
    return f"resuming {run_dir} from step {meta.step} ({meta.world_size} rank(s), {meta.strategy_name}) {how}"


def refuse_checkpointed(run_dir: Path) -> None:
    """A new launch must not silently continue (or clobber) a run that has checkpoints."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        raise UserError("the run directory already holds checkpoints", [Problem(
            "--run-dir", f"{run_dir} has the checkpoint {ckpt.name}",
            "add --resume to continue that run, or choose another --run-dir")])
