"""Read a finished (or running) run directory: its plan and its metrics.jsonl records."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.errors import Problem, UserError
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import METRICS_FILE, PLAN_FILE, read_records

NUMERIC_FIELDS = ("step", "loss", "eval_loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s",
                  "rss_peak_bytes_max_rank", "node_rss_peak_bytes", "gpu_max_allocated_bytes",
                  "gpu_max_reserved_bytes", "predicted_gpu_bytes_per_rank", "predicted_cpu_bytes_per_node")
"""The metrics.jsonl fields the report computes with: each a number (or null) in every record."""


@dataclass(frozen=True)
class Run:
    name: str
    """The run directory's name: the legend label when runs are overlaid."""
    path: Path
    plan: RunPlan
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
    _check_numbers(records, metrics_path)
    plan = RunPlan.read(plan_path, read_only=True)  # a UserError for a plan that chose nothing: nothing ran
    return Run(run_dir.resolve().name, run_dir, plan, records)


def _check_numbers(records: list[dict[str, Any]], path: Path) -> None:
    """One UserError naming every record (by step) whose report fields are not numbers."""
    problems = []
    for i, record in enumerate(records, 1):
        bad = [k for k in NUMERIC_FIELDS if k in record and (
            isinstance(record[k], bool) or not isinstance(record[k], int | float | None) or (k == "step" and record[k] is None))]
        if bad:
            problems.append(Problem(f"{path}: record {i} (step {record.get('step')!r})",
                                    ", ".join(f"{k} is {record[k]!r}" for k in bad),
                                    "repair or remove that line (orchestrate writes numbers there)"))
    if problems:
        raise UserError(f"{path} holds values that are not numbers", problems[:5] + (
            [Problem(str(path), f"and {len(problems) - 5} more records", "repair or remove those lines")]
            if len(problems) > 5 else []))
