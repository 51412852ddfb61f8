"""The libraries `train.method: lora | qlora` need, checked when the config is validated (plan time),
so a missing one is one clear message with the install command, not a traceback in rank 0.

Nothing is imported here: `importlib.util.find_spec` only looks the package up.
"""

from __future__ import annotations

import importlib.util

# method -> the import names it needs (installed by `pip install 'orchestrate[lora]'`)
METHOD_LIBRARIES = {"full": (), "lora": ("peft",), "qlora": ("peft", "bitsandbytes"), "auto": ()}
OPTIMIZER_LIBRARIES = {"adamw": (), "auto": (), "adamw8bit": ("bitsandbytes",)}


def installed(names: tuple[str, ...]) -> bool:
    """Whether every import name is installed (auto leaves out what needs a missing library)."""
    return all(importlib.util.find_spec(name) is not None for name in names)


def check_method_libraries(method: str) -> str:
    """Return `method` unchanged, or raise ValueError (pydantic turns it into the YAML-path Problem)."""
    missing = [name for name in METHOD_LIBRARIES[method] if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"train.method {method} needs {' and '.join(missing)}, not installed: run "
                         f"`pip install 'orchestrate[lora]'`" + (" or use method: full" if method == "lora"
                                                                 else " or use method: lora"))
    return method
