"""The Python API behind every CLI command: config -> hardware -> shape -> plan.

`cli.py` only parses flags, calls these functions and prints. Everything here is callable and
testable without a subprocess.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orchestrate.config.load import load_config
from orchestrate.config.schema import RunConfig
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.planner.plan import Plan


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

    def resolve(self) -> HardwareProfile:
        from orchestrate.hardware.resolve import resolve_hardware

        return resolve_hardware(profile=self.profile, gpus=self.gpus, gpu_mem=self.gpu_mem,
                                cpu_mem=self.cpu_mem, nodes=self.nodes, nvme=self.nvme,
                                gpus_per_node=self.gpus_per_node)


def plan_for(config: RunConfig, hardware: HardwareProfile) -> Plan:
    """Plan a validated config on a hardware profile (no I/O beyond reading the model's config.json)."""
    from orchestrate.model.meta import shape_for
    from orchestrate.planner.context import check_seq_len
    from orchestrate.planner.search import make_plan

    shape = shape_for(config)
    check_seq_len(config, shape)
    return make_plan(config, hardware, shape)


def plan_from_file(config_path: str | Path, overrides: tuple[str, ...] | list[str] = (),
                   hardware: HardwareFlags | HardwareProfile = HardwareFlags()) -> Plan:
    """`orchestrate plan` without the printing: load + override + validate, resolve hardware, plan."""
    config = load_config(config_path, overrides)
    profile = hardware if isinstance(hardware, HardwareProfile) else hardware.resolve()
    return plan_for(config, profile)
