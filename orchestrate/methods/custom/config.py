"""The validation of your own nn.Module's fields (`model.module`, `model.example_input`, `data.module`,
`train.loss`, `strategy.wrap`, declared in their sections' files). See docs/custom-module.md.

A module path is "package.module:Name" (the entry-point syntax of setuptools/importlib.metadata):
`Name` is an nn.Module class or a factory returning one (`model.module`), or a factory returning a
torch Dataset (`data.module`). Modules next to the YAML file import as they are (its directory is
put first on sys.path while importing, see orchestrate.methods.custom.module.import_object).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import field_validator, model_validator

from orchestrate.config.section import Section

_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def check_module_path(value: str | None) -> str | None:
    if value is not None and not _PATH.match(value):
        raise ValueError(f"{value!r} is not 'package.module:ClassOrFactory' (e.g. 'my_models.cnn:CNN')")
    return value


class ExampleTensor(Section):
    """One input of `model.example_input`: a shape (a list alone means float32) and a dtype."""

    shape: list[int]
    """One sample's shape, without the batch dimension: [16], [1, 28, 28]; [] for a scalar."""
    dtype: Literal["float32", "float16", "bfloat16", "int64", "int32", "bool"] = "float32"
    """The tensor's torch dtype: int64 for token ids and class labels."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return {"shape": v} if isinstance(v, list) else v

    @field_validator("shape")
    @classmethod
    def _sizes(cls, v: list[int]) -> list[int]:
        if any(size < 1 for size in v):
            raise ValueError(f"{v}: every size is at least 1")
        return v


def check_custom_sections(config: Any) -> None:
    """The fields of your own module go together: ValueError for a mix (RunConfig's validator)."""
    custom = config.model.module is not None
    if config.data.module is not None and not custom:
        raise ValueError("data.module feeds model.module: set model.module, or use data.train_files / data.dataset")
    if custom and (config.data.train_files or config.data.datasets or config.data.dataset):
        raise ValueError("model.module trains on data.module: remove data.train_files / data.datasets / data.dataset")
    if config.model.example_input is not None:
        if not custom:
            raise ValueError("model.example_input describes the inputs of model.module: set model.module")
        if config.data.module is not None:
            # One source for the measurement: the samples the worker trains on, or the shapes of the own loop's.
            raise ValueError("model.example_input is for your own loop, data.module for the built-in one: keep one")
    if not custom:
        if config.model.kwargs or config.data.kwargs:
            raise ValueError("model.kwargs / data.kwargs go with model.module / data.module")
        if config.train.loss != "auto":
            raise ValueError("train.loss is for model.module (Hugging Face models compute their own loss)")
        if config.strategy.wrap is not None:
            raise ValueError("strategy.wrap is for model.module (Hugging Face models name their blocks)")
    elif config.train.method != "full":
        raise ValueError("model.module trains with train.method: full (LoRA targets Hugging Face models)")
    elif config.distill is not None or config.prune is not None or config.preference is not None:
        # Teachers are causal LMs with a tokenizer, preference losses compare a causal LM's answer
        # log-probabilities and pruning rewrites Hugging Face configs: none is built for your own module yet.
        raise ValueError("distill:, preference: and prune: work on Hugging Face models, not model.module: "
                         "remove them")
