"""model.task: config validation, the model class each task builds, and the planner's logits term."""

from __future__ import annotations

import dataclasses
import json

import pytest

from orchestrate.config.load import load_config
from orchestrate.errors import UserError
from orchestrate.model.shape import ModelShape
from orchestrate.planner import constants as k
from orchestrate.planner.memory import logits_bytes
from orchestrate.planner.strategy import Strategy

BERT = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "vocab_size": 300, "max_position_embeddings": 128}


def _yaml(tmp_path, model: dict, extra: str = "") -> str:
    path = tmp_path / "m.yaml"
    path.write_text(f"model: {json.dumps(model)}\ntrain: {{seq_len: 64, global_batch_size: 8}}\n{extra}")
    return str(path)


def test_unknown_task_is_one_user_error_with_the_fix(tmp_path):
    with pytest.raises(UserError) as err:
        load_config(_yaml(tmp_path, {"architecture": BERT, "task": "classification"}))
    (problem,) = err.value.problems
    assert problem.where.startswith("model.task")
    assert "sequence-classification" in problem.fix


def test_non_causal_tasks_train_on_padded_documents(tmp_path):
    cfg = load_config(_yaml(tmp_path, {"architecture": BERT, "task": "masked-lm"}))
    assert cfg.data.packing is False
    with pytest.raises(UserError, match="packing"):
        load_config(_yaml(tmp_path, {"architecture": BERT, "task": "masked-lm"}, "data: {packing: true}\n"))


def _shape(task: str, num_labels: int = 0) -> ModelShape:
    return ModelShape(model_type="bert", parameters=1000, largest_layer_parameters=100, embedding_parameters=100,
                      lm_head_parameters=0, block_parameters=400, hidden_size=32, num_layers=2, num_heads=2,
                      num_kv_heads=2, head_dim=16, intermediate_size=64, vocab_size=30522,
                      max_position_embeddings=512, tied_embeddings=True, task=task, num_labels=num_labels)


def test_classifier_logits_are_num_labels_wide_and_one_row_per_sequence():
    s = Strategy("ddp", 0, "none", "none", "bf16", False, micro_batch_size=4)
    lm = logits_bytes(_shape("masked-lm"), s, seq_len=128)
    clf = logits_bytes(_shape("sequence-classification", num_labels=3), s, seq_len=128)
    assert lm == k.LOGITS_BYTES_PER_TOKEN_VOCAB_16BIT * 4 * 128 * 30522
    assert clf == k.LOGITS_BYTES_PER_TOKEN_VOCAB_16BIT * 4 * 3


def test_old_shapes_read_as_causal_lm():
    data = dataclasses.asdict(_shape("causal-lm"))
    del data["task"], data["num_labels"]
    assert ModelShape.from_dict(data).logits_width == 30522


def test_each_task_builds_its_class_and_the_plan_counts_the_classifier(tmp_path):
    from orchestrate.model.meta import build_meta_model, load_model_config, shape_for

    cfg = load_config(_yaml(tmp_path, {"architecture": BERT, "task": "sequence-classification", "num_labels": 3}))
    hf = load_model_config(cfg)
    names = {t: type(build_meta_model(hf, task=t)).__name__ for t in ("causal-lm", "masked-lm")}
    assert names == {"causal-lm": "BertLMHeadModel", "masked-lm": "BertForMaskedLM"}
    shape = shape_for(cfg)
    assert (shape.task, shape.num_labels, shape.logits_width, shape.lm_head_parameters) == (
        "sequence-classification", 3, 3, 0)
    hf.num_labels = 3
    model = build_meta_model(hf, task="sequence-classification")
    assert type(model).__name__ == "BertForSequenceClassification"
    assert shape.parameters == sum(p.numel() for p in model.parameters())


def test_saved_classifier_under_the_causal_task_names_the_fix(tmp_path):
    from orchestrate.model.meta import shape_for

    model_dir = tmp_path / "clf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({**BERT, "architectures": ["BertForSequenceClassification"]}))
    cfg = load_config(_yaml(tmp_path, {"name_or_path": str(model_dir)}))
    with pytest.raises(UserError) as err:
        shape_for(cfg)
    assert err.value.problems[0].fix == "set model.task: sequence-classification"


def test_num_labels_that_disagrees_with_the_data():
    from orchestrate.loading.labels import check_num_labels, configured_num_labels

    check_num_labels(["neg", "pos"], configured_num_labels({}, None), "train.csv")
    with pytest.raises(UserError, match="num_labels disagrees") as err:
        check_num_labels(["neg", "pos"], configured_num_labels({"num_labels": 3}, None), "train.csv")
    assert "model.num_labels: 2" in err.value.problems[0].fix
