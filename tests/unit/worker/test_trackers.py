"""Trackers as step callbacks: what they write is read back with each tool's own reader."""

from __future__ import annotations

import importlib.util

import pytest

from orchestrate.errors import UserError
from orchestrate.planner.strategy import Strategy
from orchestrate.run.layout import RunDir
from orchestrate.worker.callbacks.base import StepEnd, Training
from orchestrate.worker.callbacks.trackers import TB_DIR, build_trackers
from tests.helpers.engines import cpu_rank
from tests.helpers.plans import make_plan

DDP = Strategy("ddp", 0, "none", "none", "fp32", False, 2)


def _records(n: int = 5) -> list[dict]:
    out = []
    for step in range(1, n + 1):
        r = {"step": step, "loss": 5.0 / step, "lr": 1e-3 * step / n, "grad_norm": 1.0 + 0.1 * step,
             "skipped": False, "tokens": 256, "tokens_per_s": 1000.0 + step, "step_time_s": 0.25,
             "time": 1_700_000_000.0 + step, "rss_peak_bytes_max_rank": 900_000_000 + step,
             "node_rss_peak_bytes": 1_800_000_000, "predicted_gpu_bytes_per_rank": 400_000_000,
             "predicted_cpu_bytes_per_node": 2_000_000_000}
        if step % 2 == 0:
            r["eval_loss"] = 4.0 / step
        out.append(r)
    return out


def _plan(trackers: list[str]):
    return make_plan(DDP, ranks=2,
                     config={"train": {"report_to": trackers}})


def _drive(plan, run_dir, records, rank: int = 0, start_step: int = 0) -> None:
    # the trackers read the plan, the rank and the run directory only
    run = Training(plan, cpu_rank(rank, 2), RunDir(run_dir), None, None, None, None, start_step)
    trackers = build_trackers(plan)
    for t in trackers:
        t.on_train_start(run)
    for r in records:
        end = StepEnd(r["step"], final=r is records[-1], stopping=False, record=r)
        for t in trackers:
            t.on_step_end(run, end)
    for t in trackers:
        t.on_train_end(run, stopped_early=False)


def _tb_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / TB_DIR), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_has_every_step(tmp_path):
    records = _records()
    _drive(_plan(["tensorboard"]), tmp_path, records)
    acc = _tb_scalars(tmp_path)
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert loss == pytest.approx({r["step"]: r["loss"] for r in records}, rel=1e-6)
    evals = {e.step: e.value for e in acc.Scalars("eval/loss")}
    assert evals == pytest.approx({r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}, rel=1e-6)
    for tag in ("train/lr", "train/grad_norm", "perf/tokens_per_s", "memory/rss_peak_bytes_max_rank",
                "memory/predicted_gpu_bytes_per_rank"):
        assert [e.step for e in acc.Scalars(tag)] == [1, 2, 3, 4, 5], tag
    # A CPU plan has no peak FLOP/s: MFU is left out, not logged as 0.
    assert "perf/mfu" not in acc.Tags()["scalars"]
    # The plan and config texts (the text plugin stores them as tensors).
    assert {"plan/text_summary", "config/text_summary"} <= set(acc.Tags()["tensors"])


def test_tensorboard_resume_replaces_recomputed_steps(tmp_path):
    plan = _plan(["tensorboard"])
    first = _records(5)
    _drive(plan, tmp_path, first)
    # Resumed from the checkpoint of step 3: steps 4-5 are trained again with other values.
    again = [dict(r, loss=r["loss"] + 10) for r in _records(6)[3:]]
    _drive(plan, tmp_path, again, start_step=3)
    loss = {e.step: e.value for e in _tb_scalars(tmp_path).Scalars("train/loss")}
    assert sorted(loss) == [1, 2, 3, 4, 5, 6]
    assert loss[4] == pytest.approx(first[3]["loss"] + 10)


def test_only_rank_zero_writes(tmp_path):
    _drive(_plan(["tensorboard"]), tmp_path, _records(), rank=1)
    assert not (tmp_path / TB_DIR).exists()


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow not installed")
def test_mlflow_local_store_has_every_step(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    records = _records()
    _drive(_plan(["mlflow"]), tmp_path, records)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert history == pytest.approx({r["step"]: r["loss"] for r in records})
    assert run.data.params["train.seq_len"] == "32"
    assert run.data.params["plan.chosen"] == _plan(["mlflow"]).chosen.name
    assert run.info.status == "FINISHED"
    local = client.download_artifacts(run.info.run_id, "plan.json", str(tmp_path))
    assert '"chosen"' in open(local).read()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed")
def test_wandb_offline_writes_a_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    _drive(_plan(["wandb"]), tmp_path, _records())
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_missing_tracker_library_is_a_user_error(monkeypatch):
    import orchestrate.config.requirements as deps

    real = importlib.util.find_spec
    monkeypatch.setattr(deps.importlib.util, "find_spec", lambda n: None if n == "wandb" else real(n))
    with pytest.raises(UserError) as err:
        _plan(["tensorboard", "wandb"])
    assert "pip install 'orchestrate[wandb]'" in str(err.value)
    assert "train.report_to" in str(err.value)


@pytest.mark.parametrize("bad", [["none", "tensorboard"], ["tensorboard", "tensorboard"], ["comet"]])
def test_bad_report_to(bad):
    with pytest.raises(UserError):
        _plan(bad)


def test_default_is_tensorboard():
    assert _plan(["tensorboard"]).config.train.report_to == ["tensorboard"]
    plan = make_plan(DDP)
    assert plan.config.train.report_to == ["tensorboard"]
    assert build_trackers(_plan(["none"])) == []
    assert [type(t).__name__ for t in build_trackers(plan)] == ["TensorBoardTracker"]
