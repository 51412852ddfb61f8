"""A disk that fills up during a checkpoint, for real (slow): the run directory on a small tmpfs,
mounted in a user and mount namespace of its own (`unshare`, no root needed where user namespaces
are allowed; skipped where they are not). FSDP2, DDP and DeepSpeed each: a 2-rank run writes
checkpoints 2 and 4, is rolled back to 2, the tmpfs is filled to its last 256 KiB, and the resumed
run's checkpoint of step 4 fails. That is one message (no traceback) naming the checkpoint kept,
exit 2, and no partial .tmp-step-00000004 left on the full disk."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.plans import TINY_GPT2

pytestmark = pytest.mark.slow

STRATEGIES = {"fsdp": {"backend": "fsdp", "zero_stage": 3}, "ddp": {"backend": "ddp", "zero_stage": 0},
              "deepspeed": {"backend": "deepspeed", "zero_stage": 2}}

# Inside the namespace: $1 mount point, $2 config, $3 where the outputs go, $4 python.
SCRIPT = r"""
set -u
mount -t tmpfs -o size=64m tmpfs "$1"
run="$1/run"
"$4" -m orchestrate launch "$2" --gpus 2 --run-dir "$run" > "$3/first.log" 2>&1 || { echo first > "$3/failed"; exit 0; }
rm -rf "$run/checkpoints/step-00000004" "$run/model"
printf 'step-00000002\n' > "$run/checkpoints/latest"
dd if=/dev/zero of="$1/filler" bs=1M 2>/dev/null
truncate -s -256K "$1/filler"
df -k "$1" > "$3/df"
"$4" -m orchestrate launch "$2" --gpus 2 --run-dir "$run" --resume > "$3/second.log" 2>&1
echo $? > "$3/code"
ls -a "$run/checkpoints" > "$3/listing"
"$4" -c "import sys; from orchestrate.run.checkpoints import inspect_checkpoint as i; print(i(sys.argv[1]).intact)" \
    "$run/checkpoints/step-00000002" > "$3/intact"
exit 0
"""


def _unshare_works(tmp: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            f"mount -t tmpfs -o size=1m tmpfs {tmp}"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.parametrize("backend", list(STRATEGIES))
def test_disk_full_during_a_checkpoint_is_one_message_exit_2_and_no_partial_left(tmp_path: Path, backend: str):
    mount = tmp_path / "disk"
    mount.mkdir()
    if not _unshare_works(mount):
        pytest.skip("cannot mount a tmpfs here (unshare --user --map-root-user --mount is refused)")
    config = tmp_path / f"{backend}.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"architecture": dict(TINY_GPT2)},
        "train": {"seq_len": 32, "global_batch_size": 8, "micro_batch_size": 2, "max_steps": 4,
                  "checkpoint_every": 2, "keep_checkpoints": 3, "eval_every": 0, "output_dir": str(tmp_path / "runs")},
        "data": {"generate_demo_corpus": True, "cache_dir": str(tmp_path / "cache")},
        "strategy": STRATEGIES[backend]}))
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", SCRIPT, "sh",
                           str(mount), str(config), str(out), sys.executable], timeout=300)
    assert done.returncode == 0 and not (out / "failed").exists(), (out / "first.log").read_text()
    said = (out / "second.log").read_text()
    assert (out / "code").read_text().strip() == "2", said + (out / "df").read_text()
    assert "the checkpoint of step 4 could not be written: no space left on device" in said, said
    assert "step-00000002 (step 2) is kept, intact" in said and "Traceback" not in said, said
    listing = (out / "listing").read_text().split()
    assert "step-00000002" in listing and not [n for n in listing if n.startswith(".tmp-")], listing
    assert (out / "intact").read_text().strip() == "True"
