"""Workers map the one token file: N workers on a node hold one copy in the page cache, not N."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from orchestrate.data.cache import CACHE_FORMAT, META_FILE, OFFSETS_FILE, TOKENS_FILE
from tests.helpers.memory import measure_mapping_workers

MiB = 2**20
TOKENS = 24 * MiB  # uint16: a 48 MiB token file

def _entry(root: Path) -> Path:
    """A cache entry of random tokens, written directly in the cache's layout (no tokenising)."""
    root.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, 257, TOKENS, dtype=np.uint16).tofile(root / TOKENS_FILE)
    np.array([0, TOKENS], dtype=np.int64).tofile(root / OFFSETS_FILE)
    (root / META_FILE).write_text(json.dumps({"format": CACHE_FORMAT, "tokens": TOKENS, "documents": 1,
                                              "dtype": "uint16", "eos_id": 256}))
    return root


@pytest.mark.slow
def test_two_workers_share_one_copy_of_the_token_file(tmp_path: Path):
    entry = _entry(tmp_path / "entry")
    size = TOKENS * 2
    (one,) = measure_mapping_workers(entry, 1)
    two = measure_mapping_workers(entry, 2)
    print(f"token file {size / MiB:.0f} MiB; 1 worker: RSS {one['Rss'] / MiB:.1f} PSS {one['Pss'] / MiB:.1f} MiB; "
          f"2 workers: RSS {[round(w['Rss'] / MiB, 1) for w in two]} PSS {[round(w['Pss'] / MiB, 1) for w in two]} MiB; "
          f"process PSS 1 worker {one['process_pss'] / MiB:.0f} MiB, 2 workers "
          f"{sum(w['process_pss'] for w in two) / MiB:.0f} MiB")
    assert one["Rss"] > 0.95 * size  # every page was read through the mapping
    for w in two:
        assert w["Rss"] > 0.95 * size and w["Private_Clean"] + w["Private_Dirty"] < 0.05 * size
    # PSS splits shared pages: the node holds the file once, whatever the number of workers.
    assert abs(sum(w["Pss"] for w in two) - one["Pss"]) < 0.05 * size
