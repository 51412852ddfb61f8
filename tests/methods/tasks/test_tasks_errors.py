"""Bad input for model.task and labelled data: one UserError naming the YAML path and a fix, and
exit code 2 without a traceback from the CLI."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrate.config.load import load_config
from orchestrate.errors import UserError
from tests.methods.tasks.test_task_config import BERT

REPO = Path(__file__).resolve().parents[3]


def _csv(path: Path, header: list[str], rows: list[list[str]]) -> str:
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    return path.name


def _config(tmp_path: Path, model: dict | None = None, data: dict | None = None) -> Path:
    rows = [[f"text number {i}", "pos" if i % 2 else "neg"] for i in range(12)]
    path = tmp_path / "clf.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"architecture": BERT, "task": "sequence-classification", **(model or {})},
        "train": {"seq_len": 32, "global_batch_size": 2, "output_dir": "runs"},
        "data": {"train_files": [_csv(tmp_path / "train.csv", ["text", "label"], rows)], **(data or {})}}))
    return path


def _refused(path: Path) -> UserError:
    from orchestrate.data.pipeline import prepare_from_config
    from orchestrate.methods.registry import method_data

    with pytest.raises(UserError) as err:
        config = load_config(path)
        prepare_from_config(config, method_data(config), progress=False)
    return err.value


def test_a_missing_label_column_names_data_label_field_and_the_columns(tmp_path):
    (problem,) = _refused(_config(tmp_path, data={"label_field": "sentiment"})).problems
    assert problem.where == "data.label_field"
    assert "sentiment" in problem.message
    assert "set data.label_field" in problem.fix and "label" in problem.fix and "text" in problem.fix


def test_num_labels_that_disagrees_with_the_data_names_model_num_labels(tmp_path):
    (problem,) = _refused(_config(tmp_path, model={"num_labels": 3})).problems
    assert problem.where == "model.num_labels"
    assert "3 labels configured" in problem.message and "2 distinct labels (neg, pos)" in problem.message
    assert problem.fix.startswith("set model.num_labels: 2")


def test_a_label_only_in_the_validation_data_names_validation_files(tmp_path):
    val = _csv(tmp_path / "val.csv", ["text", "label"], [["a b", "pos"], ["c d", "maybe"]])
    (problem,) = _refused(_config(tmp_path, data={"validation_files": [val]})).problems
    assert problem.where == "data.validation_files" and "maybe" in problem.message and problem.fix


def test_the_cli_exits_2_with_the_path_and_fix_and_no_traceback(tmp_path):
    path = _config(tmp_path, model={"task": "text-classification"})
    done = subprocess.run([sys.executable, "-m", "orchestrate", "plan", str(path), "--gpus", "2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "Traceback" not in out
    assert "model.task" in out and "sequence-classification" in out


@pytest.mark.parametrize("task", ["masked-lm", "sequence-classification"])
def test_simulating_another_task_is_refused_not_measured_on_the_causal_head(task):
    from orchestrate.planner.strategy import Strategy
    from orchestrate.simulate.verify import verify_plan
    from tests.helpers.plans import make_plan

    plan = make_plan(Strategy("fsdp", 3, "none", "none", "fp32", False, 2), config={
        "model": {"architecture": BERT, "task": task}})
    with pytest.raises(UserError) as err:
        verify_plan(plan)
    (problem,) = err.value.problems
    assert problem.where == "model.task" and "drop --simulate" in problem.fix


@pytest.mark.parametrize("blank", ["", "  "])
def test_a_record_without_a_label_is_refused_naming_it_not_trained_as_a_class(tmp_path, blank):
    rows = [[f"text number {i}", str(i % 2)] for i in range(12)]
    rows[4][1] = blank  # the fifth record: CSV line 6
    data = {"train_files": [_csv(tmp_path / "labels.csv", ["text", "label"], rows)]}
    (problem,) = _refused(_config(tmp_path, data=data)).problems
    assert problem.where == "data.train_files[0]"
    assert "1 of 12 records" in problem.message and "record(s) 5 " in problem.message, problem.message
    assert "labels.csv" in problem.message and "give every record a label" in problem.fix
