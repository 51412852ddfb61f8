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
DEMO_CORPUS_FILE = "data/demo_corpus.txt"
REQUEUE_FILE = "REQUEUE"

WORKER_MODULE = "orchestrate.worker"
"""What torchrun runs on every rank: `python -m orchestrate.worker RUN_DIR/plan.json`."""


def worker_program(plan_path: Path) -> tuple[str, ...]:
    """torchrun's program arguments for the workers of `plan_path`."""
    return ("-m", WORKER_MODULE, str(plan_path))


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory."""

    path: Path

    @property
    def plan(self) -> Path:
        return self.path / PLAN_FILE

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
