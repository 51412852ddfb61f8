"""Read a finished (or running) run directory: its plan and its metrics.jsonl records."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.errors import Problem, UserError
from orchestrate.planner.plan import Plan
from orchestrate.run.layout import METRICS_FILE, PLAN_FILE, read_records


@dataclass(frozen=True)
class Run:
    name: str
    """The run directory's name: the legend label when runs are overlaid."""
    path: Path
    plan: Plan
    records: list[dict[str, Any]]


def load_run(run_dir: Path) -> Run:
    run_dir = Path(run_dir)
    plan_path, metrics_path = run_dir / PLAN_FILE, run_dir / METRICS_FILE
    if not plan_path.is_file():
        raise UserError(f"{run_dir} is not a run directory", [Problem(
            str(plan_path), "no plan.json", "give a directory written by `orchestrate launch` (RUN_DIR)")])
    if not metrics_path.is_file():
        raise UserError(f"{run_dir} has no metrics", [Problem(
            str(metrics_path), "metrics.jsonl is missing: the run never finished a step",
            "report on a run that trained at least one step")])
    records = read_records(metrics_path)
    if not records:
        raise UserError(f"{run_dir} has no metrics", [Problem(
            str(metrics_path), "metrics.jsonl holds no step records",
            "report on a run that trained at least one step")])
    plan = Plan.read(plan_path)
    if plan.chosen is None:
        raise UserError(f"{run_dir} has no chosen strategy", [Problem(
            str(plan_path), "the plan chose no strategy, so nothing ran", "report on a run that trained")])
    return Run(run_dir.resolve().name, run_dir, plan, records)
