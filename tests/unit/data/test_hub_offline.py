"""A dataset name that is neither a local path nor in the datasets cache, on a machine told to stay off
the Hub (HF_HUB_OFFLINE=1), is one message from `orchestrate prepare` that says so and how to get the
data there, instead of datasets' "not cached in None ... check that the file is valid data"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers.plans import TINY_GPT2

ROOT = Path(__file__).resolve().parents[3]
NAME = "orchestrate-tests/no-such-dataset"


def test_an_uncached_dataset_name_offline_says_so_and_how_to_fix_it(tmp_path):
    (tmp_path / "model.yaml").write_text(yaml.safe_dump({
        "model": {"architecture": TINY_GPT2}, "train": {"seq_len": 32, "global_batch_size": 2},
        "data": {"num_proc": 1, "cache_dir": str(tmp_path / "cache"), "datasets": [{"path": NAME}]}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    result = subprocess.run([sys.executable, "-m", "orchestrate", "prepare", str(tmp_path / "model.yaml")],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output
    assert f"the dataset '{NAME}' is not cached here" in output and "data.datasets[0].path" in output
    assert "HF_HUB_OFFLINE is set" in output and str(tmp_path / "hf") in output
    assert "save_to_disk(DIR)" in output and "unset HF_HUB_OFFLINE" in output
    assert "not cached in None" not in output and "valid data" not in output
