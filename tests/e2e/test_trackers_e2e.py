"""One real 2-rank CPU run of the demo config: trackers, the memory verdict and the report together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrate import api
from orchestrate.config.load import load_config
from orchestrate.report.summary import write_report
from tests.helpers.plans import cpu_hardware

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_rank_run_logs_to_tensorboard_and_mlflow_and_reports(tmp_path: Path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    config = load_config(ROOT / "examples" / "tiny-gpt2.yaml", [
        f"train.output_dir={tmp_path}", "train.max_steps=4", "train.eval_every=2", "train.seq_len=64",
        "train.global_batch_size=4", "train.report_to=[tensorboard, mlflow]"])
    run_dir = tmp_path / "run"
    result = api.launch(api.launch_request(config, cpu_hardware(2), name="tiny-gpt2", run_dir=run_dir))
    assert result.exit_code == 0, result.messages
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars("train/loss")} == pytest.approx(
        {r["step"]: r["loss"] for r in records}, rel=1e-6)
    assert [e.step for e in acc.Scalars("eval/loss")] == [2, 4]
    assert list((run_dir / "mlruns").glob("*/*/metrics/train/loss"))
    logs = "".join(p.read_text() for p in (run_dir / "logs").rglob("stdout.log"))
    assert logs.count("memory verdict") == 1  # rank 0 only
    report = write_report([run_dir], tmp_path / "report")
    assert len(report.images) == 4 and "memory verdict" in report.summary.read_text()
