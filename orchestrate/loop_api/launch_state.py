"""The one piece of process state between `orchestrate.loop_api.run` and `orchestrate.prepare`: the
plan this process was launched with (set once by the runner, never from the environment) and the
prepared session (so that a second `prepare` is refused)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

plan_path: Path | None = None
"""RUN_DIR/plan.json, given to `python -m orchestrate.loop_api.run` by the launcher; None outside a launch."""
session: Any = None
"""The `orchestrate.loop_api.session.Session` of the one `prepare` call; None before it."""
