"""The BERT examples: the labelled-CSV generator follows its rule, and both YAMLs plan as written
(their runs are measured in docs/tasks.md; the training itself is tests/methods/tasks/test_tasks_sharded.py)."""

from __future__ import annotations

import csv
import runpy
from pathlib import Path

import pytest

from orchestrate.api import plan_from_file
from orchestrate.hardware.presets import load_preset
from orchestrate.planner.plan import RunPlan

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def test_the_generated_csv_has_one_keyword_of_its_label_per_row(tmp_path):
    generator = runpy.run_path(str(EXAMPLES / "make_labelled_csv.py"))
    generator["main"](tmp_path)
    topics = generator["TOPICS"]
    with open(tmp_path / "train.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 600 and {r["label"] for r in rows} == set(topics)
    for row in rows:
        found = [label for label, words in topics.items() for w in row["text"].split() if w in words]
        assert found == [row["label"]], row


@pytest.mark.parametrize(("name", "task"), [("bert-classifier.yaml", "sequence-classification"),
                                            ("bert-mlm.yaml", "masked-lm")])
def test_the_bert_examples_plan(name, task):
    plan = plan_from_file(EXAMPLES / name, (), load_preset("rtx3070"))
    assert isinstance(plan, RunPlan) and plan.shape.task == task and plan.shape.model_type == "bert"
    if task == "sequence-classification":
        assert plan.config.data.label_field == "label" and plan.config.data.validation_files
        assert plan.shape.num_labels == 3
