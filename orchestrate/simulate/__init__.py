"""Memory simulation: the real HF model and the real FSDP2 / DDP / DeepSpeed wrappers run a few
training steps on fake tensors with a fake process group, while a dispatch mode counts the bytes of
live tensor storages. Per-rank peaks match real CPU runs to the byte (docs/measurements.md#simulate).

- `simulate(plan)` or `simulate(hf_config, strategy, seq_len, world_size)` -> `SimulationResult`;
  `simulate_all([plan or RunSpec, ...])` runs several at once
- `calibrate(...)` -> per-layer activation and logits coefficients for the analytical model
- `verify_plan(plan)` -> simulated vs analytical per-rank peak (what `orchestrate plan --simulate` shows)

Imports are lazy: `import orchestrate.simulate` must not pull in torch for the CLI's other commands.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrate.simulate.activation_fit import Calibration, calibrate
    from orchestrate.simulate.in_subprocess import simulate, simulate_all
    from orchestrate.simulate.result import SimulationResult
    from orchestrate.simulate.run_spec import RunSpec
    from orchestrate.simulate.verify import VerificationReport, verify_plan

_EXPORTS = {
    "simulate": "orchestrate.simulate.in_subprocess",
    "simulate_all": "orchestrate.simulate.in_subprocess",
    "calibrate": "orchestrate.simulate.activation_fit",
    "Calibration": "orchestrate.simulate.activation_fit",
    "SimulationResult": "orchestrate.simulate.result",
    "RunSpec": "orchestrate.simulate.run_spec",
    "verify_plan": "orchestrate.simulate.verify",
    "VerificationReport": "orchestrate.simulate.verify",
}
__all__ = ["Calibration", "RunSpec", "SimulationResult", "VerificationReport", "calibrate", "simulate",
           "simulate_all", "verify_plan"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'orchestrate.simulate' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
