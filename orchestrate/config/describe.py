"""`orchestrate schema`: every model.yaml key with its type, default and docstring, from the schema itself."""

from __future__ import annotations

import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from orchestrate.config.schema import RunConfig


def _type_name(annotation) -> str:
    text = str(annotation).replace("typing.", "").replace("NoneType", "None")
    return text.replace("<class '", "").replace("'>", "")


def _submodel(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _submodel(arg)
        if found:
            return found
    return None


def _walk(model: type[BaseModel], prefix: str, lines: list[str]) -> None:
    for name, field in model.model_fields.items():
        if field.exclude:
            continue  # set by the loader, not by the user
        path = f"{prefix}{name}"
        sub = _submodel(field.annotation)
        doc = " ".join((field.description or "").split())
        if sub is not None:
            lines.append(f"{path}:  {doc}")
            _walk(sub, path + ".", lines)
            continue
        if field.default is not PydanticUndefined:
            default = f"default {field.default!r}"
        elif field.default_factory is not None:
            default = f"default {field.default_factory()!r}"
        else:
            default = "required"
        lines.append(f"{path}  ({_type_name(field.annotation)}; {default})\n    {doc}")


def describe_schema() -> str:
    lines: list[str] = []
    _walk(RunConfig, "", lines)
    return "\n".join(lines)
