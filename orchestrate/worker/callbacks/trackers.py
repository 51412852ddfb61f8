"""Experiment trackers as step callbacks (OBSERVE phase, `orchestrate/worker/callbacks/base.py`): TensorBoard, wandb
(offline) and MLflow (local file store), each writing under the run directory, on rank 0 only.

`train.report_to` names them; `build_trackers(plan)` returns one callback per name from `TRACKERS`.
Each logs `step_scalars` per step, the plan (plan.json) and the config (config.yaml) as text or
params at the start, and closes its files at the end, so `tensorboard --logdir RUN_DIR`,
`wandb sync RUN_DIR/wandb/offline-run-*` and `mlflow ui --backend-store-uri RUN_DIR/mlruns` show
the run as they are. Libraries are imported only by the tracker that uses them; their presence is
checked at config validation (`orchestrate/config/requirements.py`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import yaml

from orchestrate.run.layout import CONFIG_FILE, PLAN_FILE
from orchestrate.worker.callbacks.base import Callback, StepEnd, Training
from orchestrate.worker.scalars import step_scalars

if TYPE_CHECKING:
    from orchestrate.planner.plan import RunPlan

TB_DIR = "tb"
WANDB_DIR = "."  # wandb adds its own "wandb/" below the directory it is given
MLFLOW_DIR = "mlruns"
_MLFLOW_RUN_ID = "orchestrate_run_id"  # in MLFLOW_DIR: a resumed run appends to the same MLflow run


def plan_text(plan: RunPlan) -> str:
    return json.dumps(plan.to_dict(), indent=2)


def config_text(plan: RunPlan) -> str:
    return yaml.safe_dump(plan.config.model_dump(mode="json"), sort_keys=False)


def flat_params(plan: RunPlan) -> dict[str, str]:
    """The config as dotted key -> string, plus the chosen strategy (MLflow params are flat strings)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = json.dumps(value) if not isinstance(value, str) else value

    walk("", plan.config.model_dump(mode="json"))
    out["plan.chosen"] = plan.chosen.name
    out["plan.gradient_accumulation"] = str(plan.chosen.gradient_accumulation)
    out["plan.world_size"] = str(plan.world_size)
    return out


class TensorBoardTracker(Callback):
    """torch.utils.tensorboard.SummaryWriter into RUN_DIR/tb."""

    def __init__(self) -> None:
        self.writer = None

    def on_train_start(self, training: Training) -> None:
        if not training.rank.is_main:
            return
        from torch.utils.tensorboard import SummaryWriter

        # On resume from step N, purge_step drops the events of steps > N that a crash made the run
        # recompute (as MetricsWriter does for metrics.jsonl), so TensorBoard shows each step once.
        purge = training.start_step + 1 if training.start_step else None
        self.writer = SummaryWriter(log_dir=str(training.run.path / TB_DIR), purge_step=purge, flush_secs=10)
        # Indented by four spaces: TensorBoard renders text as markdown, this keeps it verbatim.
        self.writer.add_text("plan", _verbatim(plan_text(training.plan)), global_step=training.start_step)
        self.writer.add_text("config", _verbatim(config_text(training.plan)), global_step=training.start_step)

    def on_step_end(self, training: Training, end: StepEnd) -> None:
        record = end.record
        if self.writer is None:
            return
        wall = record.get("time")
        for tag, value in step_scalars(record, training.plan).items():
            self.writer.add_scalar(tag, value, global_step=record["step"], walltime=wall)

    def on_train_end(self, training: Training, stopped_early: bool) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _verbatim(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


class WandbTracker(Callback):
    """wandb in offline mode (no network, no account) into RUN_DIR/wandb; `wandb sync` uploads it later."""

    def __init__(self) -> None:
        self.run = None

    def on_train_start(self, training: Training) -> None:
        if not training.rank.is_main:
            return
        import wandb

        self.run = wandb.init(mode="offline", dir=str(training.run.path / WANDB_DIR), project="orchestrate",
                              name=training.run.path.name, config=flat_params(training.plan), reinit="create_new")
        self.run.summary["plan_chosen"] = training.plan.chosen.name

    def on_step_end(self, training: Training, end: StepEnd) -> None:
        record = end.record
        if self.run is not None:
            self.run.log(step_scalars(record, training.plan), step=record["step"])

    def on_train_end(self, training: Training, stopped_early: bool) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if stopped_early else 0)
            self.run = None


class MlflowTracker(Callback):
    """MLflow with a local file store in RUN_DIR/mlruns (`mlflow ui --backend-store-uri RUN_DIR/mlruns`)."""

    def __init__(self) -> None:
        self.client = None
        self.run_id: str | None = None

    def on_train_start(self, training: Training) -> None:
        if not training.rank.is_main:
            return
        # MLflow 3 refuses file stores unless asked ("maintenance mode"); a local directory under the
        # run dir is the point here: no server, no database, readable by `mlflow ui` as it is.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        store = training.run.path / MLFLOW_DIR
        store.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=store.resolve().as_uri())
        id_file = store / _MLFLOW_RUN_ID
        if training.start_step and id_file.exists():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        exp = self.client.get_experiment_by_name("orchestrate")
        exp_id = exp.experiment_id if exp else self.client.create_experiment("orchestrate")
        self.run_id = self.client.create_run(exp_id, run_name=training.run.path.name).info.run_id
        id_file.write_text(self.run_id + "\n")
        from mlflow.entities import Param

        params = [Param(k[:250], v[:6000]) for k, v in flat_params(training.plan).items()]  # MLflow's limits
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params per call
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_text(self.run_id, plan_text(training.plan), PLAN_FILE)
        self.client.log_text(self.run_id, config_text(training.plan), CONFIG_FILE)

    def on_step_end(self, training: Training, end: StepEnd) -> None:
        record = end.record
        if self.client is None:
            return
        from mlflow.entities import Metric

        ms = int(1000 * record.get("time", time.time()))
        metrics = [Metric(tag, value, ms, record["step"]) for tag, value in step_scalars(record, training.plan).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def on_train_end(self, training: Training, stopped_early: bool) -> None:
        if self.client is not None:
            self.client.set_terminated(self.run_id, status="KILLED" if stopped_early else "FINISHED")
            self.client = None


TRACKERS: dict[str, Callable[[], Callback]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


def build_trackers(plan: RunPlan) -> list[Callback]:
    return [TRACKERS[name]() for name in plan.config.train.report_to if name != "none"]
