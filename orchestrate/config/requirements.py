"""The optional libraries a config needs, checked when it is validated (plan time), so a missing one
is one clear message with the install command before any worker starts, not a traceback in rank 0
mid-launch: the training method's (`train.method: lora | qlora`), the 8-bit optimizer's, the fused
kernels' (`train.fused_kernels: true`) and the experiment trackers' (`train.report_to`).

Nothing is imported here: `importlib.util.find_spec` only looks the package up.
"""

from __future__ import annotations

import importlib.util

# method -> the import names it needs (installed by `pip install 'orchestrate[lora]'`)
METHOD_LIBRARIES = {"full": (), "lora": ("peft",), "qlora": ("peft", "bitsandbytes"), "auto": ()}
OPTIMIZER_LIBRARIES = {"adamw": (), "auto": (), "adamw8bit": ("bitsandbytes",)}
FUSED_KERNEL_LIBRARIES = ("liger_kernel", "triton")  # train.fused_kernels (orchestrate/model/fused_kernels.py)
# report_to name -> (import name, pip extra of orchestrate that installs it)
TRACKER_LIBRARIES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


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


def check_optimizer_library(name: str) -> str:
    """Return the optimizer `name` unchanged, or raise ValueError naming the install command."""
    if not installed(OPTIMIZER_LIBRARIES[name]):
        raise ValueError(f"optimizer {name} needs bitsandbytes, not installed: run `pip install 'orchestrate[lora]'` "
                         "or use name: adamw")
    return name


def check_fused_kernels_library(value: bool | str) -> bool | str:
    """Return train.fused_kernels unchanged, or raise ValueError when pinned true without liger-kernel and
    Triton (auto leaves them off there)."""
    missing = [name for name in FUSED_KERNEL_LIBRARIES if importlib.util.find_spec(name) is None]
    if value is True and missing:
        raise ValueError(f"fused_kernels: true needs {' and '.join(missing)}, not installed: run "
                         "`pip install 'orchestrate[gpu]'` (liger-kernel, with Triton) or use fused_kernels: auto")
    return value


def check_trackers(names: list[str]) -> list[str]:
    """Return `names` unchanged, or raise ValueError (pydantic turns it into the YAML-path Problem)."""
    if "none" in names and len(names) > 1:
        raise ValueError('"none" cannot be combined with other trackers; give ["none"] or the trackers')
    if len(set(names)) != len(names):
        raise ValueError("a tracker is listed twice")
    missing = [n for n in names if n in TRACKER_LIBRARIES and importlib.util.find_spec(TRACKER_LIBRARIES[n][0]) is None]
    if missing:
        extras = ",".join(TRACKER_LIBRARIES[n][1] for n in missing)
        raise ValueError(f"{', '.join(missing)} not installed: run `pip install 'orchestrate[{extras}]'` "
                         f"or remove {'it' if len(missing) == 1 else 'them'} from train.report_to")
    return names
