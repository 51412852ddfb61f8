"""Reading RUN_DIR/metrics.jsonl: one JSON object per optimizer step, written by rank 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_records(path: Path) -> list[dict[str, Any]]:
    """The metrics lines; a torn last line (a run still writing, or killed mid-write) is skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records
