"""`orchestrate report RUN_DIR [RUN_DIR ...] --out DIR`: the figures as PNGs plus summary.md, one page
that reads offline (relative image links, no scripts): per run the chosen strategy, final losses,
throughput and the memory verdict."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orchestrate.errors import Problem, UserError
from orchestrate.methods.registry import active_methods
from orchestrate.report.memory_verdict import memory_verdict
from orchestrate.report.plots import FIGURES
from orchestrate.report.runs import Run, load_run
from orchestrate.run.layout import (
    REPORT_DIR,
    REPORT_MARKER_FILE,
    check_output_dir,
    is_run_dir,
    os_errors_as_user_errors,
)

SUMMARY_FILE = "summary.md"


@dataclass(frozen=True)
class Report:
    out_dir: Path
    images: list[Path]
    summary: Path


def write_report(run_dirs: list[Path], out_dir: Path | None = None) -> Report:
    """Load every run, draw the overlaid figures, write them and summary.md to `out_dir`
    (default: RUN_DIR/report of the first run). Files it did not write are never replaced
    (`check_output_dir`: a new or empty directory, an earlier report's, or a run's own report/);
    an unwritable one is a UserError naming it."""
    if not run_dirs:
        raise UserError("nothing to report", [Problem("RUN_DIR", "no run directory given",
                                                      "orchestrate report RUN_DIR [RUN_DIR ...]")])
    runs = [load_run(Path(d)) for d in run_dirs]
    out = Path(out_dir) if out_dir is not None else Path(run_dirs[0]) / REPORT_DIR
    check_output_dir(out, REPORT_MARKER_FILE, f"{SUMMARY_FILE} and {', '.join(FIGURES)}",
                     owned=out.name == REPORT_DIR and is_run_dir(out.parent))
    images = []
    with os_errors_as_user_errors("--out"):
        out.mkdir(parents=True, exist_ok=True)
        (out / REPORT_MARKER_FILE).touch()  # first: ours from now on
        for name, draw in FIGURES.items():
            fig = draw(runs)
            fig.savefig(out / name)
            images.append(out / name)
        summary = out / SUMMARY_FILE
        summary.write_text(summary_markdown(runs, [p.name for p in images]), encoding="utf-8")
    return Report(out, images, summary)


def _run_section(run: Run) -> list[str]:
    plan, last = run.plan, run.records[-1]
    chosen = plan.chosen
    evals = [r["eval_loss"] for r in run.records if r.get("eval_loss") is not None]
    tps = [r["tokens_per_s"] for r in run.records if r.get("tokens_per_s") is not None]
    lines = [f"## {run.name}", "",
             f"- path: `{run.path}`",
             f"- strategy: **{chosen.name}** on {plan.world_size} rank(s), gradient accumulation "
             f"{chosen.gradient_accumulation}; planned {chosen.speed.tokens_per_s:,.0f} tokens/s",
             f"- steps: {run.records[0]['step']}-{last['step']}; loss {run.records[0]['loss']:.4f} -> {last['loss']:.4f}"
             + (f"; eval loss {evals[0]:.4f} -> {evals[-1]:.4f}" if evals else ""),
             ]
    for method in active_methods(plan.config):
        lines += method.run_summary(plan.config, run.records)
    if tps:
        # The first step includes warm-up (allocation, kernel selection); the median is the steady rate.
        lines.append(f"- measured tokens/s (all ranks): median {sorted(tps)[len(tps) // 2]:,.0f}")
    lines += ["", "```", memory_verdict(run.records, plan).text(), "```", ""]
    return lines


def summary_markdown(runs: list[Run], images: list[str]) -> str:
    lines = ["# orchestrate report", "", ", ".join(f"`{r.name}`" for r in runs), ""]
    for run in runs:
        lines += _run_section(run)
    lines += ["## Figures", ""] + [f"![{name}]({name})" for name in images] + [""]
    return "\n".join(lines)
