"""The model.task heads train on 2 gloo ranks (DDP): a tiny BERT classifier on a generated CSV
with a learnable rule reaches 0.9 accuracy and saves its labels, and a tiny BERT masked LM lowers
its loss and loads as a masked LM."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest

from orchestrate.launch.rundir import prepare_run
from orchestrate.launch.session import start
from orchestrate.planner.strategy import Strategy
from orchestrate.transports.local.transport import LocalTorchrun
from tests.helpers.plans import make_plan

DDP = Strategy("ddp", 0, "none", "none", "fp32", False, 4)
TINY_BERT = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 128, "vocab_size": 260, "max_position_embeddings": 64}
WORDS = "the a cat dog sees runs big small red blue tree house".split()


def write_labelled_csv(path: Path, rows: int, seed: int) -> None:
    """label = whether the keyword "zebra" appears (a rule a classifier can learn)."""
    rng = random.Random(seed)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i in range(rows):
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
            if i % 2:
                words.insert(rng.randrange(len(words) + 1), "zebra")
            w.writerow([" ".join(words), "yes" if i % 2 else "no"])


def _run(tmp_path: Path, config: dict) -> Path:
    plan = make_plan(DDP, ranks=2, config=config, source_dir=tmp_path)
    run_dir = tmp_path / "run"
    assert start(prepare_run(plan, run_dir), run_dir.resolve(), LocalTorchrun()).exit_code == 0
    return run_dir


@pytest.mark.slow
def test_tiny_bert_classifier_learns_the_keyword_rule_and_saves_its_labels(tmp_path: Path):
    from transformers import AutoModelForSequenceClassification

    write_labelled_csv(tmp_path / "train.csv", 400, seed=1)
    write_labelled_csv(tmp_path / "val.csv", 64, seed=2)
    run_dir = _run(tmp_path, {
        "model": {"architecture": TINY_BERT, "task": "sequence-classification"},
        "train": {"seq_len": 64, "max_steps": 150, "eval_every": 75, "eval_batches": 8, "global_batch_size": 8,
                  "optimizer": {"lr": 2e-3, "weight_decay": 0.0}, "schedule": {"warmup_steps": 5}},
        "data": {"train_files": ["train.csv"], "validation_files": ["val.csv"], "label_field": "label"}})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = records[-1]
    print("classifier eval:", {k: v for k, v in final.items() if k.startswith("eval")})
    assert final["eval_accuracy"] >= 0.9 and final["eval_macro_f1"] >= 0.9, final
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "model")
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model.config.id2label == {0: "no", 1: "yes"} and model.config.label2id == {"no": 0, "yes": 1}


@pytest.mark.slow
def test_tiny_bert_masked_lm_lowers_its_loss_and_loads_as_masked_lm(tmp_path: Path):
    from transformers import AutoModelForMaskedLM

    run_dir = _run(tmp_path, {
        "model": {"architecture": TINY_BERT, "task": "masked-lm"},
        "train": {"seq_len": 64, "max_steps": 40, "eval_every": 20, "global_batch_size": 8,
                  "optimizer": {"lr": 2e-3}, "schedule": {"warmup_steps": 5}},
        "data": {"generate_demo_corpus": True}})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["eval_loss"], r["eval_perplexity"]) for r in records if "eval_loss" in r]
    print("masked-lm loss", records[0]["loss"], "->", records[-1]["loss"], "eval", evals)
    assert evals[-1][0] < evals[0][0] and records[-1]["loss"] < records[0]["loss"] - 1.0
    assert type(AutoModelForMaskedLM.from_pretrained(run_dir / "model")).__name__ == "BertForMaskedLM"
