"""Which backends exist and how to get one by name.

The built-in backends are named here and imported on first use (deepspeed's engine is heavy and
optional; the modules themselves import nothing heavy at import time). The backend modules do not
import this one: each defines `BACKEND`, so the registry depends on them and never the reverse.
An installed package adds its own through the entry-point group `orchestrate.backends`
(PLUGIN_GROUP), read on first use by the launcher and every worker alike; a name taken twice is
refused. The planner asks backends through here what it needs of them (their rules, their
tie-break, which memory and speed terms price them, the knobs their engines run, whether they shard
parameters), so a plug-in backend is searched, ranked and priced like a built-in one.
"""

from __future__ import annotations

import functools
import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    from orchestrate.backends.base import Backend
    from orchestrate.planner.strategy import Sharding

_BUILTIN = {  # planner search order: simpler first
    "ddp": "orchestrate.backends.ddp",
    "deepspeed": "orchestrate.backends.deepspeed_backend",
    "fsdp": "orchestrate.backends.fsdp",
}
PLUGIN_GROUP = "orchestrate.backends"
"""The entry-point group of backends other packages add: each entry point names a `Backend` that
names the built-in backend whose memory and speed terms price it (`priced_as`)."""


@functools.cache
def _plugins() -> dict[str, Backend]:
    """The backends installed packages add (PLUGIN_GROUP), by name (after the built-in ones in the
    planner's order); UserError listing every entry point
    whose backend takes a name another has, or is priced as no built-in backend."""
    found: dict[str, Backend] = {}
    problems = []
    for point in entry_points(group=PLUGIN_GROUP):
        backend, where = point.load(), f"{PLUGIN_GROUP} entry point {point.name} = {point.value}"
        if backend.name in _BUILTIN or backend.name in found:
            problems.append(Problem(where, f"names its backend {backend.name!r}, as another backend does",
                                    "rename one of them, or uninstall the package you do not use"))
        elif backend.priced_as not in _BUILTIN:
            problems.append(Problem(where, f"is priced as {backend.priced_as!r}; the memory and speed models "
                                           f"price {', '.join(_BUILTIN)}", "price it as one of them"))
        else:
            found[backend.name] = backend
    if problems:
        raise UserError("two backends share a name, or a plug-in backend is priced as no built-in one", problems)
    return dict(sorted(found.items()))


@functools.cache  # the planner asks per candidate; import_module's lookup dominated a plan's time
def _builtin(name: str) -> Backend:
    return importlib.import_module(_BUILTIN[name]).BACKEND


def backend_names() -> list[str]:
    """Every backend, built-in ones first in the planner's order."""
    return [*_BUILTIN, *_plugins()]


def get_backend(name: str) -> Backend:
    if name in _BUILTIN:
        return _builtin(name)
    try:
        return _plugins()[name]
    except KeyError:
        raise KeyError(f"unknown backend {name!r}; known: {backend_names()}") from None


def tie_break(name: str) -> int:
    """The tie-break between equally fast candidates: lower is simpler to run and debug."""
    return get_backend(name).tie_break


def priced_as(name: str) -> str:
    """The built-in backend whose memory and speed terms describe `name`."""
    return get_backend(name).priced_as


def shards_parameters(sharding: Sharding) -> bool:
    """Whether the backend shards (flattens, gathers) every parameter under `sharding`, frozen ones too:
    the one home of "is the base sharded" (LoRA's frozen base, pruning masks, QLoRA's storage dtype)."""
    return get_backend(sharding.backend).shards_parameters(sharding)


def runs_knob(name: str, knob: str) -> bool:
    """Whether the backend's engine is verified to run memory knob `knob` (planner/knobs.py)."""
    return knob in get_backend(name).knobs


def knob_backends(knob: str) -> list[str]:
    """The backends verified to run `knob`, most preferred first (what an error message offers)."""
    return sorted((n for n in backend_names() if runs_knob(n, knob)), key=tie_break)
