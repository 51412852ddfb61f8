"""Data from your own dataset factory (`data.module`): the Dataset, its samples as batches and the
validation split (the worker's TrainData is made in orchestrate.methods.custom.train_data).

Samples are dicts (keys: the model's keyword arguments, `labels` the target) or tuples
(inputs..., label); `torch.utils.data.default_collate` stacks them, tuples become the dict
{"_0": input, ..., "labels": label} (orchestrate.methods.custom.loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from orchestrate.errors import Problem, UserError
from orchestrate.methods.custom.loss import LABELS, POSITIONAL
from orchestrate.methods.custom.module import import_object

if TYPE_CHECKING:
    import torch

    from orchestrate.config.schema import RunConfig

WHERE = "data.module"


def load_dataset(config: RunConfig) -> Any:
    """`data.module(**data.kwargs)`, checked to be a map-style Dataset of dicts or tuples."""
    if config.data.module is None:
        raise UserError("model.module needs data.module", [Problem(
            WHERE, "a custom module trains (and the planner measures its activations) on data.module",
            "set data.module: 'package.module:factory' returning a torch Dataset (your own training loop, "
            "`launch -- python train.py`: model.example_input instead, docs/own-loop.md)")])
    factory = import_object(config.data.module, WHERE, config)
    try:
        dataset = factory(**config.data.kwargs)
    except Exception as exc:  # noqa: BLE001 - user code
        raise UserError("cannot build data.module", [Problem(
            WHERE, f"{config.data.module}(**kwargs) raised {type(exc).__name__}: {exc}",
            "fix data.kwargs or the factory")]) from None
    _check_dataset(dataset, config.data.module)
    return dataset


def _check_dataset(dataset: Any, name: str) -> None:
    fix = "return a torch.utils.data.Dataset with __len__ and __getitem__, each item a dict or a tuple"
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise UserError("data.module returned no Dataset", [Problem(
            WHERE, f"{name} returned a {type(dataset).__name__}, which has no __len__ / __getitem__", fix)])
    if len(dataset) < 2:
        raise UserError("data.module returned too little data", [Problem(
            WHERE, f"{name} returned {len(dataset)} sample(s)", "return at least one sample per rank and validation")])
    first = dataset[0]
    if not isinstance(first, dict | tuple | list):
        raise UserError("data.module's samples are neither dicts nor tuples", [Problem(
            WHERE, f"sample 0 is a {type(first).__name__}", fix)])


def collate(items: list[Any]) -> dict[str, torch.Tensor]:
    from torch.utils.data import default_collate

    batch = default_collate(items)
    if isinstance(batch, dict):
        return dict(batch)
    *inputs, labels = batch  # a tuple sample: inputs..., label
    return {**{f"{POSITIONAL}{i}": x for i, x in enumerate(inputs)}, LABELS: labels}


@dataclass
class DatasetSamples:
    """Samples of a Dataset at the given indices, with `.shape` / `.batch` as the token samples have."""

    dataset: Any
    indices: np.ndarray

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.indices), 1)

    def batch(self, positions: list[int]) -> dict[str, torch.Tensor]:
        return collate([self.dataset[int(self.indices[p])] for p in positions])


def split(dataset: Any, ratio: float, seed: int) -> tuple[DatasetSamples, DatasetSamples]:
    """`ratio` of the samples held out for validation, chosen by a permutation seeded with `seed`."""
    n = len(dataset)
    order = np.random.default_rng([seed, 1]).permutation(n)
    held = min(n - 1, int(round(ratio * n)))
    return DatasetSamples(dataset, np.sort(order[held:])), DatasetSamples(dataset, np.sort(order[:held]))


def check_module_data_config(config: RunConfig) -> None:
    """The launcher's data check for model.module: data.module is set (it was imported at plan time)."""
    if config.data.module is None:
        load_dataset(config)  # the UserError asking for it


def describe_module_data(config: RunConfig) -> str:
    """One line for people: what data.module gives (built once here, so a broken factory fails
    before any worker starts)."""
    train, validation = split(load_dataset(config), config.data.validation_ratio, config.train.seed)
    return f"data: {config.data.module} -> {len(train):,} train / {len(validation):,} validation samples"

