"""A classifier's labels: how many there are and their names, taken from the data and written into
the model's config (`num_labels`, `id2label`, `label2id`: what `AutoModelForSequenceClassification`
and `pipeline("text-classification")` read back)."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrate.errors import Problem, UserError


def apply_labels(hf_config, names: list[str]) -> None:
    """Size the classifier head for `names` and name its outputs (in place)."""
    hf_config.num_labels = len(names)  # transformers' setter rebuilds id2label/label2id for this count
    hf_config.id2label = dict(enumerate(names))
    hf_config.label2id = {name: i for i, name in enumerate(names)}


def configured_num_labels(model_config: dict | None, yaml_num_labels: int | None) -> tuple[int, str] | None:
    """(num_labels, where) when the user fixed it: `model.num_labels`, or a config.json /
    `model.architecture` that names `num_labels` or `id2label`; None when the data decides."""
    if yaml_num_labels is not None:
        return yaml_num_labels, "model.num_labels"
    if not model_config:
        return None
    if isinstance(model_config.get("num_labels"), int):
        return model_config["num_labels"], "model (num_labels of the model config)"
    if isinstance(model_config.get("id2label"), dict):
        return len(model_config["id2label"]), "model (id2label of the model config)"
    return None


def check_num_labels(names: list[str], configured: tuple[int, str] | None, where_data: str) -> None:
    """UserError when the configured number of labels disagrees with the data's."""
    if configured is None or configured[0] == len(names):
        return
    count, where = configured
    shown = ", ".join(names[:10]) + (" ..." if len(names) > 10 else "")
    raise UserError("num_labels disagrees with the data", [Problem(
        where, f"{count} labels configured, but {where_data} has {len(names)} distinct labels ({shown})",
        f"set model.num_labels: {len(names)} (or remove it to take the count from the data), or fix the labels")])


def write_labels(model_dir: Path, names: list[str]) -> None:
    """Put the label names into a saved model's config.json (a pretrained classifier keeps its own
    generic LABEL_i names otherwise)."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    config["id2label"] = {str(i): name for i, name in enumerate(names)}
    config["label2id"] = {name: i for i, name in enumerate(names)}
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
