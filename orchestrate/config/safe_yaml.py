"""Read user YAML (model.yaml, hardware profiles, `--set` values) with bounded time and memory.

PyYAML's `safe_load` is safe from code execution, not from resource exhaustion:
- aliases are shared nodes, so ten levels of nine aliases ("billion laughs") compose instantly but
  expand to 9**10 nodes for anything that walks the tree (our line index, pydantic);
- the composer recurses once per nesting level, so `[[[[...` 20,000 deep is a RecursionError;
- a file of tens of MB keeps the pure-Python parser busy for minutes before any error
  (docs/measurements.md#configsafe_yamlpy).
So the file size is capped before parsing, and while composing we count the expanded size of every
node and the nesting depth and refuse, with the line, past the limits. Duplicate keys, where YAML
1.1 lets the last silently win, are refused too.

Scalars follow YAML 1.2 where 1.1 surprises: booleans are only true/false (not yes/no/on/off).
Floats: YAML 1.1 (PyYAML) reads `1e-4` as a string, YAML 1.2 as a float. Users write `lr: 3e-4`;
with strict schema types the string would be refused, so `1e-4` resolves to a float here
(YAML 1.2 core schema, https://yaml.org/spec/1.2.2/#10214-floating-point).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from orchestrate.errors import Problem, UserError

MAX_BYTES = 1 << 20
"""A config is a few KiB; 1 MiB leaves room for long inline lists and bounds the parse time
(docs/measurements.md#configsafe_yamlpy)."""
MAX_NODES = 100_000
"""Nodes after alias expansion: far above any real config, far below what exhausts memory."""
MAX_DEPTH = 64
"""Nesting levels: configs use about 4; well inside Python's recursion limit."""


class _Refused(yaml.YAMLError):
    def __init__(self, mark: yaml.Mark | None, message: str, fix: str):
        super().__init__(message)
        self.mark, self.message, self.fix = mark, message, fix


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._size: dict[int, int] = {}  # id(node) -> expanded node count; shared (aliased) nodes once
        self._written = 0  # nodes as written (an alias not expanded): past MAX_NODES without any alias

    def compose_node(self, parent, index):
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _Refused(self.peek_event().start_mark, f"nesting deeper than {MAX_DEPTH} levels",
                           "flatten the structure; a config needs only a few levels")
        is_alias = self.check_event(yaml.AliasEvent)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if is_alias:
            if id(node) not in self._size:  # an alias to a node still being composed: `&a [*a]`
                raise _Refused(node.start_mark, "an alias refers to the node that contains it",
                               "remove the recursive alias")
        else:
            self._size[id(node)] = 1 + sum(self._size[id(child)] for child in _children(node))
            self._written += 1
            if self._written > MAX_NODES:  # refused where the count is passed, not after parsing the rest
                raise _Refused(node.start_mark, f"holds more than {MAX_NODES:,} values (keys, items and scalars) "
                               "by this line; a config holds a few hundred", "check that this is the right file "
                               "(not a data file); long lists of values belong in data files")
        if self._size[id(node)] > MAX_NODES:
            raise _Refused(node.start_mark, f"expands to more than {MAX_NODES:,} values (keys, items and scalars) "
                           "through aliases", "write the values out instead of nesting aliases (*name) of aliases")
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` overrides on purpose
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:
                    continue  # an unhashable key: the base constructor reports it
                if first != key_node.start_mark.line + 1:
                    raise _Refused(key_node.start_mark, f"duplicate key {key!r} (first on line {first})",
                                   "keep one of the two; YAML would silently use the last")
        return super().construct_mapping(node, deep=deep)


_BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789"))
# Booleans are YAML 1.2's true/false only: YAML 1.1's yes/no/on/off/y/n would make
# `trust_remote_code: yes` silently true (and `country: no` false). Those stay strings, which
# the strict schema then refuses for a boolean field, with the fix "write true or false".
_BoundedLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in _BoundedLoader.yaml_implicit_resolvers.items()}
_BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def read_text(path: Path, where: str) -> str:
    """The file's text: at most `MAX_BYTES` (checked before reading it all), valid UTF-8."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)  # read(), not stat(): /dev/zero and pipes have no size
    except OSError as exc:
        raise UserError(f"cannot read {path}", [Problem(where, exc.strerror or str(exc),
                                                        "check the path and its permissions")]) from None
    if len(raw) > MAX_BYTES:
        raise UserError(f"{path} is too large", [Problem(
            where, f"larger than {MAX_BYTES // 2**20} MiB; a config is a few KiB",
            "check that this is the right file (not a data file)")])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise UserError(f"{path} is not UTF-8 text", [Problem(
            f"{where} (line {line})", f"byte {raw[exc.start]:#04x} at byte offset {exc.start} is not valid UTF-8",
            "save the file as UTF-8")]) from None


def parse(text: str, where: str) -> tuple[Any, yaml.Node | None]:
    """The document's Python value and its composed node tree (for line numbers). A character YAML
    does not allow (a control character, a lone surrogate from undecodable argv bytes) is refused
    with its line, as every other problem of the text."""
    try:
        loader = _BoundedLoader(text)  # its reader checks every character first
    except yaml.reader.ReaderError as exc:
        line = text[:exc.position].count("\n") + 1
        raise UserError(f"{where} is not valid YAML", [Problem(
            f"{where} (line {line})", f"character U+{exc.character:04X} is not allowed in YAML",
            "remove it (write control characters as escapes inside double quotes: \"\\t\")")]) from None
    try:
        root = loader.get_single_node()
        return (loader.construct_document(root) if root is not None else None), root
    except _Refused as exc:
        label = f"{where} (line {exc.mark.line + 1})" if exc.mark else where
        raise UserError(f"{where} is refused", [Problem(label, exc.message, exc.fix)]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        label = f"{where} (line {mark.line + 1})" if mark else where
        raise UserError(f"{where} is not valid YAML", [Problem(
            label, " ".join(str(exc).split()), "fix the YAML syntax (indentation, quotes, brackets)")]) from None
    except RecursionError:  # defensive: the depth limit should make this unreachable
        raise UserError(f"{where} is refused", [Problem(where, "nested too deeply", "flatten it")]) from None
    finally:
        loader.dispose()


def load_file(path: Path, where: str) -> tuple[Any, yaml.Node | None]:
    return parse(read_text(path, where), where)
