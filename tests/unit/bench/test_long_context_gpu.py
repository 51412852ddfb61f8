"""bench/long_context_gpu.py: its length search (bisection, bounded in time), and its --dry-run
on CPU (orchestrate's planned longest sequence, TRL's trainer code path where TRL is installed, the table and
the JSON). The measurements need a CUDA GPU (the script's docstring has the prepared device command)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.long_context_gpu import longest

ROOT = Path(__file__).parents[3]


@pytest.mark.parametrize(("limit", "step", "expected"), [(1000, 64, 960), (1000, 256, 768), (10, 64, 0), (10**6, 64, 4096)])
def test_longest_is_the_last_multiple_that_fits(limit, step, expected):
    tried = []

    def fits(n: int) -> bool:
        tried.append(n)
        return n <= limit

    assert longest(fits, 4096, step) == expected
    assert len(tried) <= (4096 // step).bit_length() + 1  # bisection, not a scan


def test_longest_stops_at_its_deadline_with_what_fitted():
    tried = []

    def fits(n: int) -> bool:
        tried.append(n)
        return True

    assert longest(fits, 4096, 64, deadline=time.monotonic() - 1) == 0 and tried == []


@pytest.mark.slow
def test_dry_run_plans_orchestrates_longest_and_writes_the_table(tmp_path):
    proc = subprocess.run([sys.executable, "bench/long_context_gpu.py", "--dry-run", "--out", str(tmp_path),
                           "--work", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "long_context.json").read_text())
    rows = {r["method"]: r for r in doc["table"]}
    assert list(rows) == ["orchestrate", "trl", "unsloth"] and doc["cuda"] is False
    mine = doc["results"][0]
    assert mine["longest_seq_len"] == mine["planned"]["seq_len"] > 0 and "needs a CUDA GPU" in rows["orchestrate"]["note"]
    assert mine["planned"]["gpu_bytes"] <= 8 * 2**30

    from bench import long_context_gpu as lc
    from orchestrate.api import is_runnable
    from orchestrate.config.load import config_from_dict
    from orchestrate.hardware.flags import HardwareFlags
    from orchestrate.planning import plan_for

    hw = HardwareFlags(gpus=1, gpu_mem="8GiB", cpu_mem="64GiB", calibration=False).resolve()
    longer = lc.orchestrate_config(tmp_path / "work" / "base-llama3.1-8b", mine["longest_seq_len"] + 64, 3, tmp_path)
    assert not is_runnable(plan_for(config_from_dict(longer, ROOT), hw))  # the longest: 64 more does not fit
    if importlib.util.find_spec("trl") is None:
        assert rows["trl"]["note"] == "skipped: trl is not importable here"
    else:  # TRL's SFTTrainer + peft ran its steps on a tiny Llama
        assert rows["trl"]["tokens_per_s"] > 0 and doc["results"][1]["best"]["seq_len"] == 64
    assert rows["unsloth"]["note"].startswith("skipped: ")
    assert "orchestrate" in proc.stdout and "peak reserved GiB" in proc.stdout
