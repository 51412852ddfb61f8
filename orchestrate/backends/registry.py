"""Which backends exist and how to get one by name.

The built-in backends are named here and imported on first use (deepspeed's engine is heavy and
optional; the modules themselves import nothing heavy at import time). The backend modules do not
import this one: each defines `BACKEND`, so the registry depends on them and never the reverse.
`register` adds another backend; a name taken twice is refused, as torchtitan's
`register_train_spec` does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrate.backends.base import Backend

_BUILTIN = {  # planner search order: simpler first
    "ddp": "orchestrate.backends.ddp",
    "deepspeed": "orchestrate.backends.deepspeed_backend",
    "fsdp": "orchestrate.backends.fsdp",
}
_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    if backend.name in _REGISTRY or backend.name in _BUILTIN:
        raise ValueError(f"a backend named {backend.name!r} is registered already")
    _REGISTRY[backend.name] = backend
    return backend


def backend_names() -> list[str]:
    """Every backend, built-in ones first in the planner's order."""
    return [*_BUILTIN, *_REGISTRY]


def get_backend(name: str) -> Backend:
    if name in _BUILTIN:
        return importlib.import_module(_BUILTIN[name]).BACKEND
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown backend {name!r}; known: {backend_names()}") from None
