"""Which backends exist and how to get one by name.

The built-in backends are named here and imported on first use (deepspeed's engine is heavy and
optional; the modules themselves import nothing heavy at import time). The backend modules do not
import this one: each defines `BACKEND`, so the registry depends on them and never the reverse.
`register` adds another backend; a name taken twice is refused, as torchtitan's
`register_train_spec` does. The planner asks backends through here what it needs of them (their
rules, their tie-break, which memory and speed terms price them, the knobs their engines
run, whether they shard parameters), so a registered backend is searched, ranked and priced like a
built-in one.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrate.backends.base import Backend
    from orchestrate.planner.strategy import Sharding

_BUILTIN = {  # planner search order: simpler first
    "ddp": "orchestrate.backends.ddp",
    "deepspeed": "orchestrate.backends.deepspeed_backend",
    "fsdp": "orchestrate.backends.fsdp",
}
_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add a backend; it names the built-in backend whose memory and speed terms price it (`priced_as`)."""
    if backend.name in _REGISTRY or backend.name in _BUILTIN:
        raise ValueError(f"a backend named {backend.name!r} is registered already")
    if backend.priced_as not in _BUILTIN:
        raise ValueError(f"backend {backend.name!r} is priced as {backend.priced_as!r}; the memory and speed "
                         f"models price {', '.join(_BUILTIN)}")
    _REGISTRY[backend.name] = backend
    return backend


@functools.cache  # the planner asks per candidate; import_module's lookup dominated a plan's time
def _builtin(name: str) -> Backend:
    return importlib.import_module(_BUILTIN[name]).BACKEND


def backend_names() -> list[str]:
    """Every backend, built-in ones first in the planner's order."""
    return [*_BUILTIN, *_REGISTRY]


def get_backend(name: str) -> Backend:
    if name in _BUILTIN:
        return _builtin(name)
    try:
        return _REGISTRY[name]
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
