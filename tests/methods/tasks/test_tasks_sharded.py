"""The model.task heads under the sharded backends, 2 gloo ranks: the tiny BERT classifier and masked
LM of tests/methods/tasks/test_tasks_e2e.py under FSDP2 (full shard) and DeepSpeed ZeRO-2 / ZeRO-3, and a
masked-LM run resumed from a checkpoint that repeats the uninterrupted run bit for bit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from orchestrate.launch.rundir import prepare_run
from orchestrate.launch.session import start
from orchestrate.planner.strategy import Strategy
from orchestrate.transports.local.transport import LocalTorchrun
from tests.helpers.plans import make_plan
from tests.methods.tasks.test_tasks_e2e import TINY_BERT, write_labelled_csv

REPO = Path(__file__).resolve().parents[3]
SHARDED = {"fsdp-full": Strategy("fsdp", 3, "none", "none", "fp32", False, 4),
           "deepspeed-z2": Strategy("deepspeed", 2, "none", "none", "fp32", False, 4),
           "deepspeed-z3": Strategy("deepspeed", 3, "none", "none", "fp32", False, 4)}
MASKED_LM = {**{k: v for k, v in SHARDED.items() if k != "deepspeed-z2"},
             "fsdp-grad_op-bf16-ac": Strategy("fsdp", 2, "none", "none", "bf16", True, 4)}
"""The masked LM's tied head under parameter sharding (ZeRO-2 keeps every weight whole, as the classifier
under it shows), and under bf16 autocast with each BertLayer in a checkpoint wrapper."""


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path: Path, strategy: Strategy, config: dict) -> Path:
    plan = make_plan(strategy, ranks=2, config=config, source_dir=tmp_path)
    run_dir = tmp_path / "run"
    assert start(prepare_run(plan, run_dir), run_dir.resolve(), LocalTorchrun()).exit_code == 0
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHARDED))
def test_sharded_bert_classifier_reaches_0_9_and_saves_its_labels(name, tmp_path: Path):
    from transformers import AutoModelForSequenceClassification

    write_labelled_csv(tmp_path / "train.csv", 400, seed=1)
    write_labelled_csv(tmp_path / "val.csv", 64, seed=2)
    run_dir = _run(tmp_path, SHARDED[name], {
        "model": {"architecture": TINY_BERT, "task": "sequence-classification"},
        "train": {"seq_len": 64, "max_steps": 120, "eval_every": 120, "eval_batches": 8, "global_batch_size": 8,
                  "optimizer": {"lr": 2e-3, "weight_decay": 0.0}, "schedule": {"warmup_steps": 5}},
        "data": {"train_files": ["train.csv"], "validation_files": ["val.csv"], "label_field": "label"}})
    final = _metrics(run_dir)[-1]
    print(name, "classifier eval:", {k: round(v, 4) for k, v in final.items() if k.startswith("eval")})
    assert final["eval_accuracy"] >= 0.9 and final["eval_macro_f1"] >= 0.9, final
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "model")
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model.config.id2label == {0: "no", 1: "yes"} and model.config.label2id == {"no": 0, "yes": 1}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MASKED_LM))
def test_sharded_bert_masked_lm_lowers_its_loss_and_loads_tied(name, tmp_path: Path):
    from transformers import AutoModelForMaskedLM

    run_dir = _run(tmp_path, MASKED_LM[name], {
        "model": {"architecture": TINY_BERT, "task": "masked-lm"},
        "train": {"seq_len": 64, "max_steps": 30, "eval_every": 15, "global_batch_size": 8,
                  "optimizer": {"lr": 2e-3}, "schedule": {"warmup_steps": 5}},
        "data": {"generate_demo_corpus": True}})
    records = _metrics(run_dir)
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    print(name, "masked-lm loss", records[0]["loss"], "->", records[-1]["loss"], "eval", evals)
    assert evals[-1] < evals[0] and records[-1]["loss"] < records[0]["loss"] - 1.0
    model = AutoModelForMaskedLM.from_pretrained(run_dir / "model")
    assert type(model).__name__ == "BertForMaskedLM"
    # The decoder is tied to the word embeddings again, with the trained values (not a fresh init).
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight


def _launch(config: Path, run_dir: Path, *extra: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "orchestrate", "launch", str(config), "--gpus", "2",
                           "--run-dir", str(run_dir), *extra], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.slow
def test_masked_lm_resumed_under_fsdp_repeats_the_uninterrupted_run_bit_for_bit(tmp_path: Path):
    """Same masks after the resume (their generator is seeded by the checkpointed sampler place),
    hence the same per-step losses and identical final weights."""
    from safetensors.torch import load_file

    config = tmp_path / "mlm.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"architecture": TINY_BERT, "task": "masked-lm"},
        "train": {"seq_len": 64, "global_batch_size": 8, "micro_batch_size": 2, "max_steps": 8,
                  "checkpoint_every": 4, "seed": 0, "optimizer": {"lr": 2e-3}, "schedule": {"warmup_steps": 2},
                  "output_dir": "runs"},
        "data": {"generate_demo_corpus": True}, "strategy": {"backend": "fsdp", "zero_stage": 3}}))
    ref = tmp_path / "ref"
    _launch(config, ref)
    resumed = tmp_path / "resumed"
    shutil.copytree(ref, resumed)  # as if the run had crashed right after the checkpoint of step 4
    shutil.rmtree(resumed / "checkpoints" / "step-00000008")
    (resumed / "checkpoints" / "latest").write_text("step-00000004\n")
    shutil.rmtree(resumed / "model")
    _launch(config, resumed, "--resume")
    got, want = _metrics(resumed), _metrics(ref)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    a, b = load_file(str(resumed / "model" / "model.safetensors")), load_file(str(ref / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
