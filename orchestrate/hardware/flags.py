"""The hardware flags every command shares (`--gpus 2 --gpu-mem 8GiB ...`), before resolution."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrate.hardware.calibration import calibration_path
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.hardware.resolve import resolve_hardware


@dataclass(frozen=True)
class HardwareFlags:
    """The hardware flags every command shares (`--gpus 2 --gpu-mem 8GiB ...`); None = not given."""

    profile: str | None = None
    gpus: int | None = None
    gpu_mem: str | None = None
    cpu_mem: str | None = None
    nodes: int | None = None
    nvme: str | None = None
    gpus_per_node: int | None = None
    """Always GPUs, also from a machine without (see `resolve_hardware`); `gpus` is ranks per node."""
    calibration: bool = True
    """Apply this machine's calibration file (hardware/calibration.py); `--no-calibration`: False."""

    def resolve(self) -> HardwareProfile:
        return resolve_hardware(profile=self.profile, gpus=self.gpus, gpu_mem=self.gpu_mem,
                                cpu_mem=self.cpu_mem, nodes=self.nodes, nvme=self.nvme,
                                gpus_per_node=self.gpus_per_node,
                                calibration=calibration_path() if self.calibration else None)
