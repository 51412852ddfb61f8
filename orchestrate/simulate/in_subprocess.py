"""`simulate(...)`: one fake-tensor training run per fresh subprocess, result as a `SimulationResult`;
`simulate_all(...)`: several of them at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from orchestrate.planner.plan import RunPlan
from orchestrate.planner.strategy import Strategy
from orchestrate.simulate.result import SimulationResult
from orchestrate.simulate.run_spec import RunSpec, plan_from_parts, spec_from_plan

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def make_spec(target: RunPlan | RunSpec | Any, strategy: Strategy | None = None, seq_len: int | None = None,
              world_size: int | None = None, *, hardware: Any = None, rank: int = 0, steps: int = 2) -> RunSpec:
    """The run to simulate: a plan's chosen candidate, a ready `RunSpec`, or (HF config, strategy,
    seq_len, world_size) set up as on `hardware` (default: the generic 8 GB GPU preset)."""
    if isinstance(target, RunSpec):
        return target
    if isinstance(target, RunPlan):
        return spec_from_plan(target, steps=steps, rank=rank)
    if strategy is None or seq_len is None or world_size is None:
        raise TypeError("simulate(hf_config, strategy, seq_len, world_size): all four are needed")
    plan = plan_from_parts(target, strategy, seq_len, world_size, hardware)
    return spec_from_plan(plan, steps=steps, rank=rank)


def simulate(target: RunPlan | RunSpec | Any, strategy: Strategy | None = None, seq_len: int | None = None,
             world_size: int | None = None, *, hardware: Any = None, rank: int = 0, steps: int = 2,
             timeout_s: float = 900) -> SimulationResult:
    """Per-rank memory of `steps` real training steps on fake tensors (see `make_spec` for targets).

    Runs in a fresh interpreter: the fake process group, DeepSpeed's globals and the patches a
    simulation installs must not outlive it."""
    spec = make_spec(target, strategy, seq_len, world_size, hardware=hardware, rank=rank, steps=steps)
    with tempfile.TemporaryDirectory(prefix="orchestrate-sim-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec.to_dict()))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")
        # torchrun's variables of the calling process would mislead DeepSpeed in the child.
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        proc = subprocess.run([sys.executable, "-m", "orchestrate.simulate.runner", str(spec_path), str(result_path)],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not result_path.is_file():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-25:])
            raise RuntimeError(f"simulation of {spec.strategy_obj.name} failed (exit {proc.returncode}):\n{tail}")
        return SimulationResult.from_dict(json.loads(result_path.read_text()))


def simulate_all(targets: list[RunPlan | RunSpec], parallel: int = 2) -> list[SimulationResult]:
    """`simulate(target)` for each, `parallel` subprocesses at a time (each is mostly one core's Python),
    results in order."""
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(simulate, targets))
