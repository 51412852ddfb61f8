"""Hardware flags: --nvme must be an existing writable directory; every problem's fix is accepted."""

from __future__ import annotations

import os

import pytest

from orchestrate.errors import UserError
from orchestrate.hardware.resolve import resolve_hardware


def _no_detect():
    raise AssertionError("detection must not run when --profile is given")


def _problems(**flags):
    with pytest.raises(UserError) as info:
        resolve_hardware(profile="rtx3070", detect=_no_detect, **flags)
    assert all(p.fix for p in info.value.problems), str(info.value)
    return info.value.problems


def test_nvme_that_does_not_exist_is_refused(tmp_path):
    [problem] = _problems(nvme=str(tmp_path / "nonexistent"))
    assert problem.where == "--nvme" and "does not exist" in problem.message


def test_nvme_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    [problem] = _problems(nvme=str(tmp_path / "f"))
    assert "not a directory" in problem.message


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to a read-only directory")
def test_nvme_that_is_read_only_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        [problem] = _problems(nvme=str(ro))
    finally:
        ro.chmod(0o700)
    assert "not writable" in problem.message


def test_nvme_existing_directory_reports_its_free_space(tmp_path):
    profile = resolve_hardware(profile="rtx3070", nvme=str(tmp_path), detect=_no_detect)
    assert profile.nvme_path == str(tmp_path) and profile.nvme_free_bytes > 0


@pytest.mark.parametrize("value", ["0", "512", "0GiB", "100MiB"])
def test_gpu_mem_fix_suggests_an_accepted_value(value):
    [problem] = _problems(gpu_mem=value)
    suggested = problem.fix.split("write ")[-1].rstrip("?") if "write " in problem.fix else "1GiB"
    suggested = suggested.split()[-1]
    profile = resolve_hardware(profile="rtx3070", gpu_mem=suggested, detect=_no_detect)
    assert profile.gpu.memory_bytes >= 2**30


@pytest.mark.parametrize("flag", ["gpus", "nodes", "gpus_per_node"])
def test_counts_below_one_have_a_fix(flag):
    [problem] = _problems(**{flag: 0})
    assert "1 or more" in problem.fix
