"""Run directories written by another orchestrate version: one rule, decided here for every reader of
plan.json (`orchestrate report`, `chat`, `export`, and `launch --resume`).

- The read-only commands (`report`, `chat`, `export`) read what they can of a plan.json of another
  `schema_version`: the parts this version knows are read, the others are skipped and named, and a
  plan whose known parts do not read is one message naming the version to use. A finished run stays
  readable by a newer orchestrate.
- `--resume` refuses it: training continues only under the plan format the checkpoint was written
  with. The fix names that (resume with the version that wrote it), or exporting the model and
  starting a new run from it; never "plan the run again", which would start over.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrate.errors import Problem, UserError

PLAN_SCHEMA_VERSION = 1
"""plan.json's layout version (docs/plan-json.md): bump when a field changes meaning or goes away."""
PLAN_FIELDS = ("schema_version", "model", "hardware", "config", "config_source_dir", "world_size", "candidates",
               "chosen", "chosen_candidate", "files", "notes", "run")
"""The top-level fields of plan.json at PLAN_SCHEMA_VERSION."""
RESUME_FIX = ("resume it with the orchestrate version that wrote it, or `orchestrate export RUN_DIR --out DIR` "
              "and start a new run from it (model.name_or_path: DIR)")
READ_FIX = "read it with the orchestrate version that wrote it"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def check_plan_version(data: Any, path: Path, read_only: bool, say: Callable[[str], None] = _stderr) -> None:
    """The rule of the module docstring for the parsed plan.json `data` at `path`. `read_only`: a
    `report`, `chat` or `export` reads it (another version is read as far as it goes, and what is
    skipped is said to `say`); else `--resume` (another version is a UserError)."""
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version == PLAN_SCHEMA_VERSION:
        return
    if not read_only:
        raise OtherVersion(f"{path} was written by another orchestrate version", [Problem(
            str(path), f"plan schema_version {version!r}; this version resumes {PLAN_SCHEMA_VERSION} only",
            RESUME_FIX)])
    skipped = sorted(set(data) - set(PLAN_FIELDS)) if isinstance(data, dict) else []
    say(f"{path} is plan schema_version {version!r}, this version's is {PLAN_SCHEMA_VERSION}: read as far as it goes"
        + (f"; skipped the fields this version does not know: {', '.join(skipped)}" if skipped else ""))


class OtherVersion(UserError):
    """A run directory's file written by another orchestrate version: the fix is that version, not
    the one for a damaged file (`orchestrate export` tells the two apart)."""


def unreadable_other_version(path: Path, version: Any, why: str) -> OtherVersion:
    """A plan of another version whose known fields do not read either (a read-only command)."""
    return OtherVersion(f"{path} was written by another orchestrate version and cannot be read by this one", [Problem(
        str(path), f"plan schema_version {version!r} (this version's is {PLAN_SCHEMA_VERSION}): {why}", READ_FIX)])
