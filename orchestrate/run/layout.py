"""Every file and folder name of a run directory, defined once (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PLAN_FILE = "plan.json"
CONFIG_FILE = "config.yaml"
ACCELERATE_FILE = "accelerate.yaml"
LOG_DIR = "logs"
LAUNCH_SCRIPT = "launch.sh"
SBATCH_SCRIPT = "job.sbatch"
METRICS_FILE = "metrics.jsonl"
INIT_MODEL_DIR = "init_model"
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
"""A LoRA / QLoRA run's adapter in PEFT format (MODEL_DIR holds the merged model)."""
DEMO_CORPUS_FILE = "data/demo_corpus.txt"
TEACHER_CACHE_DIR = "teacher_cache"
"""distill.placement precomputed: the teacher's top-k logits per training token (numpy memmaps)."""
REQUEUE_FILE = "REQUEUE"
MARKER_FILE = ".orchestrate-run"
"""Written first into every run directory: what makes a directory orchestrate's (`orchestrate.run.marker`)."""
LOCK_FILE = ".lock"
"""flock'ed by the launcher for the whole launch; names its holder (`orchestrate.run.lock`)."""
EXPORT_MARKER_FILE = ".orchestrate-export"
"""Written by `orchestrate export` into its output directory, so that it may replace its own files."""
REPORT_DIR = "report"
"""`orchestrate report RUN_DIR` writes its PNGs and summary.md here unless --out says otherwise."""
REPORT_MARKER_FILE = ".orchestrate-report"
"""Written first by `orchestrate report` into its output directory, as EXPORT_MARKER_FILE."""

WORKER_MODULE = "orchestrate.worker"
"""What torchrun runs on every rank: `python -m orchestrate.worker RUN_DIR/plan.json`."""


USER_PROGRAM_MODULE = "orchestrate.loop_api.run"
"""What torchrun runs for `launch -- python train.py ARGS`: `python -m orchestrate.loop_api.run
RUN_DIR/plan.json -- train.py ARGS` (the plan path is its argument; the script gets its own argv)."""


def worker_program(plan_path: Path, module: str = WORKER_MODULE, program: tuple[str, ...] = ()) -> tuple[str, ...]:
    """torchrun's program arguments for the workers of `plan_path` (`module`: a wrapper that ends in
    `orchestrate.worker.main.main`, e.g. bench/gpu_worker.py). With the user's own `program`
    (`SCRIPT ARGS` or `-m MODULE ARGS`), that program under the plan instead (docs/own-loop.md)."""
    if program:
        return ("-m", USER_PROGRAM_MODULE, str(plan_path), "--", *program)
    return ("-m", module, str(plan_path))


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory."""

    path: Path

    @property
    def plan(self) -> Path:
        return self.path / PLAN_FILE

    @property
    def adapter(self) -> Path:
        return self.path / ADAPTER_DIR

    @property
    def config(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def logs(self) -> Path:
        return self.path / LOG_DIR

    @property
    def launch_script(self) -> Path:
        return self.path / LAUNCH_SCRIPT

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def init_model(self) -> Path:
        return self.path / INIT_MODEL_DIR

    @property
    def model(self) -> Path:
        return self.path / MODEL_DIR

    @property
    def requeue(self) -> Path:
        return self.path / REQUEUE_FILE

    @property
    def marker(self) -> Path:
        return self.path / MARKER_FILE

    @property
    def lock(self) -> Path:
        return self.path / LOCK_FILE
