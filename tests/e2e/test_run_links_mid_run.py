"""A symbolic link placed in a run directory while it trains is refused at the write (slow; issue 38,
item 2): the demo on 2 CPU ranks, and once it has trained a few steps RUN_DIR/model (or, after its
first checkpoint, RUN_DIR/checkpoints) is replaced by a link to a directory of the user's. The run
ends with exit 2 and one message naming the link, no traceback, and nothing written where it points."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "tiny-gpt2.yaml"


def _steps(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("name", ["model", "checkpoints"])
def test_a_link_placed_while_the_run_trains_is_refused_at_the_save(tmp_path: Path, name: str):
    run_dir, outside = tmp_path / "run", tmp_path / "elsewhere"
    outside.mkdir()
    command = [sys.executable, "-m", "orchestrate", "launch", "--gpus", "2", str(DEMO), "--run-dir", str(run_dir),
               "--set", "train.max_steps=40", "--set", "train.eval_every=0",
               "--set", f"train.checkpoint_every={20 if name == 'checkpoints' else 0}",
               "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        ready = (lambda: (run_dir / "checkpoints" / "latest").is_file()) if name == "checkpoints" else (
            lambda: _steps(run_dir) >= 3)
        deadline = time.monotonic() + 240
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before the link could be placed"
        link = run_dir / name
        if link.exists():
            link.rename(tmp_path / f"{name}-moved")
        link.symlink_to(outside, target_is_directory=True)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, out
    assert "refused to write through a symbolic link" in out and f"rm {link}" in out and "Traceback" not in out, out
    assert list(outside.iterdir()) == []
