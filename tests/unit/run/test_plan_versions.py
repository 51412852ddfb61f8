"""One rule for a run directory written by another orchestrate version (issue 38, item 4;
orchestrate/run/versions.py): `report`, `chat` and `export` read what they can of a plan.json of
another schema_version and say what they skipped; `launch --resume` refuses it, naming the version
that wrote it or an export as the fix, never "plan the run again"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrate.chat import _plan as chat_plan
from orchestrate.cli import cli
from orchestrate.errors import UserError
from orchestrate.run.layout import RunDir
from orchestrate.run.versions import PLAN_SCHEMA_VERSION, READ_FIX, RESUME_FIX, check_plan_version
from tests.unit.report.test_report import _records, _write_run
from tests.unit.run import test_checkpoint_integrity as integrity

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny-gpt2.yaml"
OTHER = PLAN_SCHEMA_VERSION + 1
fsdp_run = integrity.fsdp_run


def _from_another_version(plan_path: Path, drop: str | None = None) -> None:
    """plan.json as a later version might write it: another schema_version, a field this one does not
    know, and (`drop`) without a field this one needs."""
    data = json.loads(plan_path.read_text())
    data.update(schema_version=OTHER, future_field={"x": 1})
    if drop:
        del data[drop]
    plan_path.write_text(json.dumps(data))


def test_the_rule_reads_another_version_for_read_only_commands_and_refuses_it_for_resume(tmp_path: Path):
    said: list[str] = []
    data = {"schema_version": OTHER, "future_field": 1}
    check_plan_version(data, tmp_path / "plan.json", read_only=True, say=said.append)
    assert said and f"schema_version {OTHER}" in said[0] and "future_field" in said[0]
    with pytest.raises(UserError) as err:
        check_plan_version(data, tmp_path / "plan.json", read_only=False)
    assert RESUME_FIX in str(err.value)
    said.clear()
    check_plan_version({"schema_version": PLAN_SCHEMA_VERSION}, tmp_path / "plan.json", True, said.append)
    assert said == []


def test_report_reads_another_version_and_names_what_it_skipped(tmp_path: Path):
    run = _write_run(tmp_path / "run", _records())
    _from_another_version(run / "plan.json")
    result = CliRunner().invoke(cli, ["report", str(run), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert f"schema_version {OTHER}" in result.output and "future_field" in result.output
    assert (tmp_path / "out" / "summary.md").is_file()
    _from_another_version(run / "plan.json", drop="hardware")
    result = CliRunner().invoke(cli, ["report", str(run), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "another orchestrate version" in result.output and READ_FIX in result.output
    assert "plan the run again" not in result.output and "Traceback" not in result.output


def test_chat_reads_another_version_and_says_so(tmp_path: Path, capsys):
    run = _write_run(tmp_path / "run", _records())
    _from_another_version(run / "plan.json")
    assert chat_plan(RunDir(run)).chosen is not None
    assert f"schema_version {OTHER}" in capsys.readouterr().err


def test_export_reads_a_checkpoint_plan_of_another_version(fsdp_run: Path, tmp_path: Path, capsys):
    from orchestrate.export import export_checkpoint

    ckpt = fsdp_run / "checkpoints" / "step-00000002"
    _from_another_version(ckpt / "plan.json")
    integrity.write_manifest(ckpt)
    assert export_checkpoint(fsdp_run, tmp_path / "out", say=print) == ckpt
    assert (tmp_path / "out" / "model.safetensors").is_file() and "future_field" in capsys.readouterr().err
    _from_another_version(ckpt / "plan.json", drop="config")
    integrity.write_manifest(ckpt)
    with pytest.raises(UserError) as err:
        export_checkpoint(fsdp_run, tmp_path / "out2", step=2)
    assert "another orchestrate version" in str(err.value) and READ_FIX in str(err.value)


def test_resume_refuses_another_version_with_the_fix_for_a_finished_run(tmp_path: Path):
    run = tmp_path / "run"
    made = CliRunner().invoke(cli, ["launch", "--gpus", "2", str(TINY), "--dry-run", "--run-dir", str(run),
                                    "--set", f"train.output_dir={tmp_path / 'runs'}"])
    assert made.exit_code == 0, made.output
    _from_another_version(run / "plan.json")
    result = CliRunner().invoke(cli, ["launch", "--gpus", "2", str(TINY), "--resume", "--run-dir", str(run),
                                      "--dry-run"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "another orchestrate version" in text and "orchestrate export RUN_DIR --out DIR" in text
    assert "plan the run again" not in text and "Traceback" not in text
