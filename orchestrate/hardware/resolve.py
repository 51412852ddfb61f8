"""The hardware a plan is made for: a preset or profile file (`--profile`), else this machine,
then the CLI's hardware flags on top. Every bad flag is reported at once, in one `UserError`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import yaml

from orchestrate.errors import Problem, UserError
from orchestrate.hardware.alloc_conf import expandable_segments_in, user_alloc_conf
from orchestrate.hardware.calibration import with_calibration
from orchestrate.hardware.detect import detect_hardware, free_space
from orchestrate.hardware.presets import load_preset, load_profile
from orchestrate.hardware.profile import MAX_MEMORY_BYTES, HardwareProfile
from orchestrate.hardware.software import SoftwareStack, installed_software
from orchestrate.hardware.units import format_bytes, parse_size
from orchestrate.run.layout import os_errors_as_user_errors

# No GPU or host worth planning for has less; a smaller number is a size typed without its unit.
_MIN_MEMORY = 2**30


def resolve_hardware(
    profile: str | None = None,
    gpus: int | None = None,
    gpu_mem: str | None = None,
    cpu_mem: str | None = None,
    nodes: int | None = None,
    nvme: str | None = None,
    gpus_per_node: int | None = None,
    detect: Callable[[], HardwareProfile] = detect_hardware,
    software: Callable[[], SoftwareStack] = installed_software,
    environ: Mapping[str, str] | None = None,
    calibration: Path | None = None,
) -> HardwareProfile:
    """The profile to plan for.

    `gpus` is ranks per node: GPUs on a GPU profile, gloo worker processes on a CPU-only one.
    `gpus_per_node` always means GPUs: on a CPU-only profile it plans for a GPU machine you do not
    have, as `gpu_mem` does; both then use the `generic-8gb` preset's throughputs.
    A profile without library versions gets this interpreter's (`software`).
    `environ` (default: this process's): the user's CUDA allocator configuration, if any, decides
    `expandable_segments` (hardware/alloc_conf.py). `calibration`: the calibration file whose entries
    for this machine become memory corrections (hardware/calibration.py).
    """
    resolved = _resolve(profile, gpus, gpu_mem, cpu_mem, nodes, nvme, gpus_per_node, detect)
    user_conf = user_alloc_conf(os.environ if environ is None else environ)
    if user_conf is not None:
        resolved = resolved.model_copy(update={"expandable_segments": expandable_segments_in(user_conf[1])})
    resolved = _with_software(resolved, software)
    return resolved if calibration is None else with_calibration(resolved, calibration)


def _with_software(profile: HardwareProfile, software: Callable[[], SoftwareStack]) -> HardwareProfile:
    if profile.software != SoftwareStack():
        return profile  # pinned by the profile file
    return profile.model_copy(update={"software": software()})


def _resolve(profile: str | None, gpus: int | None, gpu_mem: str | None, cpu_mem: str | None, nodes: int | None,
             nvme: str | None, gpus_per_node: int | None, detect: Callable[[], HardwareProfile]) -> HardwareProfile:
    problems: list[Problem] = []
    gpu_mem_bytes = _memory(gpu_mem, "--gpu-mem", problems)
    cpu_mem_bytes = _memory(cpu_mem, "--cpu-mem", problems)
    for value, flag in ((gpus, "--gpus"), (gpus_per_node, "--gpus-per-node"), (nodes, "--nodes")):
        if value is not None and value < 1:
            problems.append(Problem(flag, f"must be at least 1, got {value}", f"pass {flag} 1 or more"))
    if gpus is not None and gpus_per_node is not None and gpus != gpus_per_node:
        problems.append(Problem("--gpus-per-node", f"{gpus_per_node} contradicts --gpus {gpus}",
                                "give only one of them"))
    nvme_space = _collect(lambda: free_space(nvme, "--nvme"), problems) if nvme else None
    base = _collect(lambda: load_profile(profile), problems) if profile else None
    if problems:
        raise UserError("invalid hardware options", problems)
    if base is None:
        base = detect()

    update: dict = {}
    gpu_count = gpus_per_node or gpus
    if base.has_gpu:
        if gpu_mem_bytes is not None:
            update["gpu"] = base.gpu.model_dump() | {"memory_bytes": gpu_mem_bytes}
        if gpu_count is not None:
            update["gpus_per_node"] = gpu_count
    elif gpu_mem_bytes is not None or gpus_per_node is not None:
        # Planning for a GPU machine from one without: the profile's own GPU spec if a file gave one.
        spec = base.gpu or load_preset("generic-8gb").gpu
        update["gpu"] = spec.model_dump() | {"memory_bytes": gpu_mem_bytes or spec.memory_bytes}
        update["gpus_per_node"] = gpu_count or 1
    elif gpus is not None:
        update["cpu_processes"] = gpus
    if cpu_mem_bytes is not None:
        update["cpu_memory_bytes"] = cpu_mem_bytes
    if nodes is not None:
        update["nodes"] = nodes
    if nvme_space is not None:
        update["nvme_path"], update["nvme_free_bytes"] = nvme_space
    if not update:
        return base
    return HardwareProfile.model_validate(base.model_dump() | update | {"name": f"{base.name}+flags"})


PROFILE_HEADER = "# orchestrate hardware profile: sizes in bytes, bandwidths in bytes/s, TFLOPS dense.\n"
"""The first line of every profile file `profile --out` writes: how it knows a file is its own."""


def profile_to_yaml(profile: HardwareProfile) -> str:
    """A profile file `--profile path.yaml` reads back to an equal profile."""
    return PROFILE_HEADER + yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False)


def write_profile(profile: HardwareProfile, path: Path) -> Path:
    """`profile --out FILE`: a new file, or one an earlier `profile --out` wrote (it starts with
    PROFILE_HEADER); any other file is left alone (UserError), as is an unwritable path."""
    path = Path(path)
    if path.is_dir() or (path.exists() and not _starts_with(path, PROFILE_HEADER)):
        raise UserError("--out names a file orchestrate did not write", [Problem(
            "--out", f"{path} exists and is not a profile `orchestrate profile --out` wrote; it would be replaced",
            "give a new file name: --out NEW.yaml (or remove that one)")])
    with os_errors_as_user_errors("--out"):
        path.write_text(profile_to_yaml(profile))
    return path


def _starts_with(path: Path, text: str) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(len(text.encode())) == text.encode()
    except OSError:
        return False


def _memory(text: str | None, flag: str, problems: list[Problem]) -> int | None:
    if text is None:
        return None
    size = _collect(lambda: parse_size(text, flag), problems)
    if size is not None and size < _MIN_MEMORY:
        digits = str(text).strip()
        # Suggest "<n>GiB" only where that is itself accepted: "0GiB" is not.
        fix = (f"sizes without a unit are bytes: write {int(digits)}GiB?" if digits.isdigit() and int(digits) >= 1
               else "give at least 1GiB")
        problems.append(Problem(flag, f"{text!r} is only {format_bytes(size)}", fix))
        return None
    if size is not None and size > MAX_MEMORY_BYTES:
        problems.append(Problem(flag, f"{text!r} is more than any machine has (at most {format_bytes(MAX_MEMORY_BYTES)})",
                                "give the memory of one GPU (--gpu-mem) or of one node (--cpu-mem), e.g. 8GiB"))
        return None
    return size


def _collect(read: Callable, problems: list[Problem]):
    """`read()`, or None with its problems added to `problems` when it raises `UserError`."""
    try:
        return read()
    except UserError as exc:
        problems.extend(exc.problems)
        return None
