"""The per-machine calibration file: what this machine's finished GPU runs and out-of-memory errors
measured against the analytical memory model, applied to the next plan on the same machine.

$XDG_CACHE_HOME/orchestrate/calibration.json (default ~/.cache/orchestrate/calibration.json) holds
one entry per key — GPU model, driver, CUDA runtime, torch version, strategy family
(`Strategy.family`) — with the last `KEPT_RATIOS` ratios measured / analytical prediction
(a finished run's allocated peak with the reserve and context planned for it; an OOM's lower
bound of the need: launch/calibration_record.py).

Applied, a matching entry becomes a `MemoryCorrection` of its family with the largest kept ratio,
and only when it is above 1: a plan on this machine is never predicted lower than the analytical
model says (an over-prediction costs speed; an under-prediction is an OOM on the user's card, and one
lucky run must not talk the model down). The largest of the last few, not of all time, so that an
old outlier (a driver since updated shows as another key anyway) ages out.

Only a profile detected on this machine, with a GPU and its driver version known, is matched: a
preset, a profile file or flags that invent a GPU describe another machine. `--no-calibration`
ignores the file. Resolved with the hardware profile (hardware/resolve.py), never in the planner.
Written whole (a temporary file in the same folder, then renamed); never through a symbolic link.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrate.hardware.profile import HardwareProfile, MemoryCorrection

FILE_VERSION = 1
KEPT_RATIOS = 10


class MachineKey(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu: str
    driver: str
    cuda: str | None
    torch: str | None


class Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    machine: MachineKey
    family: str
    ratios: list[float] = Field(default_factory=list)
    """measured / analytical, oldest first, the last KEPT_RATIOS."""
    sources: list[str] = Field(default_factory=list)
    """What measured each ratio (a run directory's memory verdict, an OOM at a step), as `ratios`."""
    updated: str = ""

    @property
    def ratio(self) -> float:
        return max(self.ratios, default=1.0)


class CalibrationFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = FILE_VERSION
    entries: list[Entry] = Field(default_factory=list)


def calibration_path(env: dict[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    cache = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(cache) / "orchestrate" / "calibration.json"


def machine_key(profile: HardwareProfile) -> MachineKey | None:
    """This machine's key, or None when the profile is not one detected here with a GPU."""
    if not (profile.name.startswith("detected:") and profile.has_gpu and profile.driver_version):
        return None
    return MachineKey(gpu=profile.gpu.name, driver=profile.driver_version, cuda=profile.software.cuda,
                      torch=profile.software.torch)


def read_calibration(path: Path) -> CalibrationFile:
    """The file's entries; an absent, unreadable or foreign file counts as empty (it is a cache)."""
    try:
        return CalibrationFile.model_validate_json(Path(path).read_text())
    except (OSError, ValueError, ValidationError):
        return CalibrationFile()


def corrections(profile: HardwareProfile, calibration: CalibrationFile, path: Path) -> list[MemoryCorrection]:
    """The entries of this machine with a ratio above 1, as corrections of their families."""
    key = machine_key(profile)
    if key is None:
        return []
    return [MemoryCorrection(ratio=e.ratio, family=e.family, source=str(path),
                             reason=f"largest of {len(e.ratios)} measured/predicted ratio(s) of {e.family} "
                                    f"runs on this machine")
            for e in calibration.entries if e.machine == key and e.ratio > 1.0]


def with_calibration(profile: HardwareProfile, path: Path) -> HardwareProfile:
    """`profile` with this machine's calibration entries from `path` added to its corrections (the
    file is not read for a profile that is not this machine's GPU)."""
    if machine_key(profile) is None:
        return profile
    found = corrections(profile, read_calibration(path), path)
    if not found:
        return profile
    return profile.model_copy(update={"memory_corrections": [*profile.memory_corrections, *found]})


def add_measurement(calibration: CalibrationFile, key: MachineKey, family: str, ratio: float,
                    source: str) -> CalibrationFile:
    """The file with `ratio` appended to the entry of (key, family), the last KEPT_RATIOS kept."""
    entries = [e.model_copy(deep=True) for e in calibration.entries]
    entry = next((e for e in entries if e.machine == key and e.family == family), None)
    if entry is None:
        entry = Entry(machine=key, family=family)
        entries.append(entry)
    entry.ratios = [*entry.ratios, round(ratio, 4)][-KEPT_RATIOS:]
    entry.sources = [*entry.sources, source][-KEPT_RATIOS:]
    entry.updated = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return CalibrationFile(entries=entries)


def write_calibration(path: Path, calibration: CalibrationFile) -> None:
    """Written whole; OSError when the file or its folder is a symbolic link (never written through)."""
    path = Path(path)
    for part in (path, path.parent):
        if part.is_symlink():
            raise OSError(f"{part} is a symbolic link: the calibration file is not written through links")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(calibration.model_dump(mode="json"), indent=1) + "\n")
    tmp.replace(path)


def record(profile: HardwareProfile, family: str, ratio: float, source: str, path: Path | None = None) -> str | None:
    """Append one measurement of this machine (None: the profile is not this machine's GPU, nothing
    written); returns the line the launcher prints. A write that fails is said, not raised: the
    run itself is done."""
    key = machine_key(profile)
    if key is None:
        return None
    path = calibration_path() if path is None else path
    try:
        write_calibration(path, add_measurement(read_calibration(path), key, family, ratio, source))
    except OSError as exc:
        return f"calibration not recorded: {exc}"
    return f"calibration: measured/predicted {ratio:.2f} for {family} on {key.gpu} recorded in {path}"

