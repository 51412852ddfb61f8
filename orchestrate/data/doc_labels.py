"""Per-document labels of a classifier's cache entry: LABELS_FILE holds one int64 per document,
an index into the entry's sorted label names (meta.json `label_names`).

Names are the label values as text, sorted numerically when every one is an integer (so labels
0..K-1 keep their ids) and as strings otherwise. A validation entry has its own names; `label_ids`
maps them onto the training names (a label never seen in training is an error).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from orchestrate.errors import Problem, UserError

LABELS_FILE = "labels.bin"


def sorted_names(values: set[str]) -> list[str]:
    try:
        return sorted(values, key=int)
    except ValueError:
        return sorted(values)


def write_labels(entry: Path, labels: list[str]) -> list[str]:
    """Write `labels` (one per document, as text) to entry/LABELS_FILE; returns the label names."""
    names = sorted_names(set(labels))
    index = {name: i for i, name in enumerate(names)}
    np.array([index[label] for label in labels], dtype=np.int64).tofile(entry / LABELS_FILE)
    return names


def read_labels(entry: Path, num_documents: int) -> np.ndarray:
    return np.memmap(entry / LABELS_FILE, dtype=np.int64, mode="r", shape=(num_documents,))


def label_ids(ids: np.ndarray, names: list[str], train_names: list[str], where: str) -> np.ndarray:
    """`ids` (indexes into `names`) as indexes into the training names."""
    position = {name: i for i, name in enumerate(train_names)}
    unseen = [n for n in names if n not in position]
    if unseen:
        raise UserError("the validation data has labels the training data lacks", [Problem(
            where, f"labels {', '.join(unseen[:10])} appear only in the validation data",
            "train on data that has every label, or drop those validation records")])
    return np.array([position[n] for n in names], dtype=np.int64)[np.asarray(ids)]
