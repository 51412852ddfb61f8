"""Which tracker needs which library, checked when the config is validated (plan time), so a missing
library is one clear message before any worker starts, not a traceback in rank 0 mid-launch.

No tracker library is imported here: `importlib.util.find_spec` only looks the package up.
"""

from __future__ import annotations

import importlib.util

# report_to name -> (import name, pip extra of orchestrate that installs it)
TRACKER_LIBRARIES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


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
