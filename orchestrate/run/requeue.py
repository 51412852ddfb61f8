"""The REQUEUE marker: workers that checkpointed on a stop signal leave RUN_DIR/REQUEUE.

torchrun reports any failed worker as exit 1, so the marker file is what callers read:
`orchestrate launch` exits EX_TEMPFAIL (75) when it is there, and a batch script can test
`[ -f RUN_DIR/REQUEUE ]`. A worker that starts removes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrate.run.layout import REQUEUE_FILE


def write_requeue(run_dir: Path, record: dict[str, Any]) -> Path:
    path = Path(run_dir) / REQUEUE_FILE
    tmp = path.with_name(REQUEUE_FILE + ".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(path)
    return path


def read_requeue(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / REQUEUE_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return {}  # present but unreadable: still a request to requeue


def clear_requeue(run_dir: Path) -> None:
    (Path(run_dir) / REQUEUE_FILE).unlink(missing_ok=True)
