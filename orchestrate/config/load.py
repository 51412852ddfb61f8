"""Load model.yaml: parse, apply `--set a.b=value` overrides, validate, report every problem at once.

Problems carry their YAML path and, when the key is in the file, its line number, so the user can
jump straight to it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from orchestrate.config import safe_yaml
from orchestrate.config.fixes import fix_for
from orchestrate.config.schema import RunConfig
from orchestrate.config.train import DEFAULT_OUTPUT_DIR
from orchestrate.errors import Problem, UserError


def _line_index(node: yaml.Node, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], int]:
    """Map each YAML key path to its 1-based line number, from the composed node tree."""
    lines: dict[tuple[str, ...], int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = prefix + (str(key_node.value),)
            lines[path] = key_node.start_mark.line + 1
            lines.update(_line_index(value_node, path))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = prefix + (str(i),)
            lines[path] = item.start_mark.line + 1
            lines.update(_line_index(item, path))
    return lines


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> tuple[list[tuple[list[str], Any]], list[Problem]]:
    """Parse `--set dotted.path=value` strings; values are YAML scalars (`512`, `true`, `[a, b]`); a
    key with a control character, or a value YAML refuses, is a Problem."""
    parsed, problems = [], []
    for item in overrides:
        key, sep, raw = item.partition("=")
        label = f"--set {item}" if item.isprintable() else f"--set {item!r}"  # no control character printed raw
        if not sep or not key.strip() or any(not part for part in key.strip().split(".")) or not key.isprintable():
            problems.append(Problem(label, "expected dotted.path=value", "e.g. --set train.seq_len=512"))
            continue
        try:
            value = safe_yaml.parse(raw, label)[0] if raw.strip() else None
        except UserError as exc:
            problems += exc.problems
            continue
        parsed.append((key.strip().split("."), value))
    return parsed, problems


def _apply_override(data: dict, path: list[str], value: Any) -> None:
    cursor = data
    for part in path[:-1]:
        nxt = cursor.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            cursor[part] = nxt
        cursor = nxt
    cursor[path[-1]] = value


_UNION_TAG = re.compile(r"^(int|float|str|bool|none|list\[.*\]|dict\[.*\]|tuple\[.*\]|literal\[.*\]|function-\w+\[.*\])$")


def _problems_from_validation(exc: ValidationError, lines: dict[tuple[str, ...], int]) -> list[Problem]:
    """One Problem per YAML path; the alternatives of a union (`int | "auto"`) are merged into one message."""
    by_where: dict[str, Problem] = {}
    for err in exc.errors():
        # pydantic appends the union member it tried (`int`, `literal['auto']`) to the location.
        loc = [str(p) for p in err["loc"] if not _UNION_TAG.match(str(p))]
        where = ".".join(loc) or "(top level)"
        line = lines.get(tuple(loc))
        label = f"{where} (line {line})" if line else where
        msg, fix = err["msg"], fix_for(err)
        if err["type"] == "extra_forbidden":
            msg, fix = "unknown key", "remove it or check the spelling; `orchestrate schema` lists every key"
        elif err["type"] == "missing":
            msg, fix = "required key is missing", f"add `{loc[-1]}:`"
        elif err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        elif "input" in err:
            msg += f" (got {err['input']!r})"
        if label in by_where:  # another alternative of the same union failed too
            prev = by_where[label]
            by_where[label] = Problem(label, prev.message + "; or " + msg.split(" (got")[0], prev.fix)
        else:
            by_where[label] = Problem(label, msg, fix)
    return list(by_where.values())


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read, override and validate a model.yaml; raise `UserError` listing every problem."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"cannot read config {path}", [Problem(str(path), "file not found", "check the path")])
    data, root = safe_yaml.load_file(path, str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path} must be a mapping", [Problem(str(path), "top level is not a mapping",
                                                             "start with `model:` and `train:`")])
    lines = _line_index(root) if root is not None else {}
    parsed, problems = parse_overrides(overrides)
    for key_path, value in parsed:
        _apply_override(data, key_path, value)
    config = None
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        problems += _problems_from_validation(exc, lines)
    if problems:
        raise UserError(f"{path} has {len(problems)} problem(s)", problems)
    assert config is not None  # internal invariant: no problems means validation succeeded
    config.source_dir = path.resolve().parent
    if config.train.output_dir is None:  # fixed now: the workers, on any node, read it from plan.json
        config.train.output_dir = str(Path.cwd().resolve() / DEFAULT_OUTPUT_DIR)
    return config


def config_from_dict(data: dict, source_dir: Path | None = None) -> RunConfig:
    """Validate an already-parsed config (used by workers reading plan.json and by tests). Relative
    paths resolve against `source_dir`, the unset train.output_dir included (`RunConfig.output_root`)."""
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        problems = _problems_from_validation(exc, {})
        raise UserError(f"config has {len(problems)} problem(s)", problems) from None
    config.source_dir = source_dir
    return config
