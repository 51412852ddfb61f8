"""NCCL settings some consumer GPUs need, as a rule table checked against the hardware profile.

These are NCCL's own environment variables (NCCL reads nothing else), not orchestrate settings.
The launcher puts them into the workers' environment, records them in plan.json's `run` section
(the worker applies them too, so a plain `torchrun` of the plan behaves the same), and prints why.
A variable the user already set is never overridden.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrate.hardware.profile import HardwareProfile


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


@dataclass(frozen=True)
class NcclRule:
    name: str
    applies: Callable[[HardwareProfile], bool]
    env: dict[str, str]
    reason: str


def _rtx40_old_driver(hw: HardwareProfile) -> bool:
    # accelerate.utils.environment.check_cuda_p2p_ib_support (used by `accelerate launch`): more
    # than one "RTX 40" card with a driver older than 550.40.07 hangs or corrupts data with P2P/IB.
    # An unknown driver version counts as old: disabling P2P costs speed, a hang costs the run.
    if not hw.has_gpu or hw.gpus_per_node < 2 or "RTX 40" not in hw.gpu.name:
        return False
    return hw.driver_version is None or _version(hw.driver_version) < _version("550.40.07")


RULES: tuple[NcclRule, ...] = (
    NcclRule(
        name="rtx40-p2p",
        applies=_rtx40_old_driver,
        env={"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"},
        reason="several RTX 40-series GPUs with an NVIDIA driver older than 550.40.07 (or unknown): "
               "GPU peer-to-peer and InfiniBand transfers are disabled for NCCL, as `accelerate launch` does",
    ),
)


def nccl_rules(hw: HardwareProfile) -> list[NcclRule]:
    """The rules that apply to this hardware, in table order."""
    return [rule for rule in RULES if rule.applies(hw)]


def nccl_env(hw: HardwareProfile) -> dict[str, str]:
    """The NCCL environment variables this hardware needs (empty for most machines)."""
    env: dict[str, str] = {}
    for rule in nccl_rules(hw):
        env.update(rule.env)
    return env
