"""The plan: every candidate the planner weighed and the one it chose, serialisable to plan.json.

plan.json is the only channel from the launcher to the workers: the worker rebuilds everything
(config, hardware, model shape, strategy, batch arithmetic, file locations) from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrate.config.schema import RunConfig
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.model.shape import ModelShape
from orchestrate.planner.estimate import MemoryEstimate, SpeedEstimate
from orchestrate.planner.strategy import Strategy

PLAN_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    memory: MemoryEstimate
    speed: SpeedEstimate
    gradient_accumulation: int
    fits: bool
    reason: str = ""
    """Why it was rejected ("" when it fits): which limit it overflows and by how much."""
    teacher_placement: str | None = None
    """distill: where the teacher lives in this candidate (methods/distill/memory.py); None without one."""

    @property
    def name(self) -> str:
        return self.strategy.name

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "fits": self.fits,
            "gpu_bytes_per_rank": self.memory.gpu_total,
            "cpu_bytes_per_node": self.memory.cpu_total,
            "tokens_per_s": self.speed.tokens_per_s,
            "reason": self.reason,
            "gradient_accumulation": self.gradient_accumulation,
            "strategy": self.strategy.to_dict(),
            "memory": self.memory.to_dict(),
            "speed": self.speed.to_dict(),
            **({"teacher_placement": self.teacher_placement} if self.teacher_placement else {}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Candidate:
        return cls(
            strategy=Strategy.from_dict(data["strategy"]),
            memory=MemoryEstimate.from_dict(data["memory"]),
            speed=SpeedEstimate.from_dict(data["speed"]),
            gradient_accumulation=int(data["gradient_accumulation"]),
            fits=bool(data["fits"]),
            reason=data.get("reason", ""),
            teacher_placement=data.get("teacher_placement"),
        )


@dataclass(frozen=True)
class RunSection:
    """plan.json's `run` section, written by the launcher with the run directory: the environment
    the libraries under the workers need (never orchestrate settings) and why."""

    created: str
    env: dict[str, str] = field(default_factory=dict)
    env_notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"created": self.created, "env": dict(self.env), "env_notes": list(self.env_notes)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSection:
        return cls(created=data.get("created", ""), env=dict(data.get("env", {})),
                   env_notes=list(data.get("env_notes", [])))


@dataclass
class Plan:
    config: RunConfig
    hardware: HardwareProfile
    shape: ModelShape
    candidates: list[Candidate]
    chosen: Candidate | None
    files: dict[str, str] = field(default_factory=dict)
    """Files the launcher wrote for this plan, by role ("backend_config", "model_dir", ...),
    as paths relative to the plan file's directory."""
    run: RunSection | None = None
    """Set when the plan belongs to a run directory (see RunSection)."""
    notes: list[str] = field(default_factory=list)
    """What the planner decided beyond the strategy, and why (e.g. which method `train.method: auto` took)."""

    @property
    def world_size(self) -> int:
        return self.hardware.world_size

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "model": {"parameters": self.shape.parameters, "shape": self.shape.to_dict()},
            "hardware": self.hardware.model_dump(mode="json"),
            "config": self.config.model_dump(mode="json"),
            "config_source_dir": str(self.config.source_dir) if self.config.source_dir else None,
            "world_size": self.world_size,
            "candidates": [c.to_dict() for c in self.candidates],
            "chosen": self.chosen.name if self.chosen else None,
            "chosen_candidate": self.chosen.to_dict() if self.chosen else None,
            "files": dict(self.files),
            "notes": list(self.notes),
            **({"run": self.run.to_dict()} if self.run is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        from orchestrate.config.load import config_from_dict

        src = data.get("config_source_dir")
        chosen = Candidate.from_dict(data["chosen_candidate"]) if data.get("chosen_candidate") else None
        return cls(
            config=config_from_dict(data["config"], Path(src) if src else None),
            hardware=HardwareProfile.model_validate(data["hardware"]),
            shape=ModelShape.from_dict(data["model"]["shape"]),
            candidates=[Candidate.from_dict(c) for c in data["candidates"]],
            chosen=chosen,
            files=dict(data.get("files", {})),
            run=RunSection.from_dict(data["run"]) if "run" in data else None,
            notes=list(data.get("notes", [])),
        )

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")
        tmp.replace(path)  # atomic: a reader never sees half a plan
        return path

    @classmethod
    def read(cls, path: Path) -> Plan:
        """The plan in `path`; a missing, damaged or foreign file is a UserError naming it."""
        from orchestrate.errors import Problem, UserError

        try:
            return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        except UserError as exc:  # its config no longer validates
            raise UserError(f"the plan {path} cannot be used", exc.problems) from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"the plan {path} cannot be read", [Problem(
                str(path), f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                "restore it: every checkpoint keeps a copy (checkpoints/step-N/plan.json); or write a new run "
                "directory (--run-dir NEW)")]) from None
