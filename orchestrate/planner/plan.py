"""The plan: every candidate the planner weighed and, when one fits, the one it chose, as typed
pydantic models with one serialisation (plan.json, `orchestrate plan --json`).

`make_plan` returns a `RunPlan` (its `chosen` is never None: a runnable plan) or a `Refusal`
(nothing fits: the table still prints, and `orchestrate.planning.require_feasible` turns it into the
error with the closest candidates and the remedies). plan.json is the only channel from the
launcher to the workers, and holds a RunPlan only: the worker rebuilds everything (config,
hardware, model shape, strategy, batch arithmetic, file locations) from it.
"""

from __future__ import annotations

import json
from dataclasses import field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, computed_field, model_serializer, model_validator
from pydantic.dataclasses import dataclass

from orchestrate.config.load import config_from_dict
from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem, UserError
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.model.shape import ModelShape
from orchestrate.planner.estimate import MemoryEstimate, SpeedEstimate
from orchestrate.planner.strategy import Strategy, tokens_per_step
from orchestrate.run.versions import PLAN_SCHEMA_VERSION, check_plan_version, unreadable_other_version

_PLACEMENT = "_placement"


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    memory: MemoryEstimate
    speed: SpeedEstimate
    gradient_accumulation: int
    fits: bool
    reason: str = ""
    """Why it was rejected ("" when it fits): which limit it overflows and by how much."""
    placements: dict[str, str] = field(default_factory=dict)
    """Where each auxiliary model of its methods lives in this candidate ({"teacher": "sharded"};
    planner/auxiliary.py); serialised as `<model>_placement`."""
    placement_reason: str = ""
    """Auto placements: the cheaper placements it passed over and why ("" when it took the first;
    left out of plan.json then)."""

    @computed_field
    @property
    def name(self) -> str:
        return self.strategy.name

    @computed_field
    @property
    def gpu_bytes_per_rank(self) -> int:
        return self.memory.gpu_total

    @computed_field
    @property
    def cpu_bytes_per_node(self) -> int:
        return self.memory.cpu_total

    @computed_field
    @property
    def tokens_per_s(self) -> float:
        return self.speed.tokens_per_s

    @model_serializer(mode="wrap")
    def _flat_placements(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        placements = data.pop("placements")
        if not data.get("placement_reason"):
            data.pop("placement_reason", None)
        return {**data, **{f"{name}{_PLACEMENT}": where for name, where in placements.items()}}

    @model_validator(mode="before")
    @classmethod
    def _nested_placements(cls, data: Any) -> Any:
        if isinstance(data, dict) and "placements" not in data:
            data = {**data, "placements": {k.removesuffix(_PLACEMENT): v for k, v in data.items()
                                           if k.endswith(_PLACEMENT)}}
        return data


@dataclass(frozen=True)
class RunSection:
    """plan.json's `run` section, written by the launcher with the run directory: the environment
    the libraries under the workers need (never orchestrate settings) and why."""

    created: str = ""
    env: dict[str, str] = field(default_factory=dict)
    env_notes: list[str] = field(default_factory=list)


class RunFiles(BaseModel):
    """The files the launcher wrote for a plan, as paths relative to the plan file's directory.
    plan.json holds them by role: config, logs, metrics, model_out, backend_config (then
    backend_config:<name> for more), accelerate_config, demo_corpus, <tool>:<name>."""

    model_config = ConfigDict(extra="forbid")

    config: str | None = None
    logs: str | None = None
    metrics: str | None = None
    model_out: str | None = None
    backend: list[str] = []
    """The backend's rendered config files, the main one first."""
    accelerate_config: str | None = None
    demo_corpus: str | None = None
    """The generated demo corpus (data.generate_demo_corpus)."""
    tools: dict[str, str] = {}
    """Files written for another tool (`orchestrate config --for TOOL`), by "<tool>:<name>"."""

    def names(self) -> list[str]:
        """Every file, in the order of plan.json's roles."""
        return list(self._roles().values())

    def _roles(self) -> dict[str, str]:
        roles = {k: v for k in ("config", "logs", "metrics", "model_out") if (v := getattr(self, k))}
        roles.update({"backend_config" if i == 0 else f"backend_config:{name}": name for i, name in enumerate(self.backend)})
        roles.update({k: v for k in ("accelerate_config", "demo_corpus") if (v := getattr(self, k))})
        return {**roles, **self.tools}

    @model_serializer(mode="plain")
    def _by_role(self) -> dict[str, str]:
        return self._roles()

    @model_validator(mode="before")
    @classmethod
    def _from_roles(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(k.startswith("backend_config") or ":" in k for k in data):
            return data
        out: dict[str, Any] = {"backend": [], "tools": {}}
        for role, name in data.items():
            if role.startswith("backend_config"):
                out["backend"].append(name)
            elif ":" in role:
                out["tools"][role] = name
            else:
                out[role] = name
        return out


class PlanResult(BaseModel):
    """Every candidate the planner weighed for a config on a hardware profile, best first."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    config: RunConfig
    hardware: HardwareProfile
    shape: ModelShape
    candidates: list[Candidate]
    notes: list[str] = []
    """What the planner decided beyond the strategy, and why (e.g. which method the auto method took)."""

    @property
    def world_size(self) -> int:
        return self.hardware.world_size

    @model_serializer(mode="wrap")
    def _plan_json(self, handler: Any) -> dict[str, Any]:
        """plan.json's layout (docs/plan-json.md), the same since schema version 1."""
        data = handler(self)
        chosen = data.get("chosen")
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "model": {"parameters": self.shape.parameters, "shape": data["shape"]},
            "hardware": data["hardware"],
            "config": data["config"],
            "config_source_dir": str(self.config.source_dir) if self.config.source_dir else None,
            "world_size": self.world_size,
            "candidates": data["candidates"],
            "chosen": chosen["name"] if chosen else None,
            "chosen_candidate": chosen,
            "files": data.get("files", {}),
            "notes": data["notes"],
            **({"run": data["run"]} if data.get("run") is not None else {}),
        }

    @model_validator(mode="before")
    @classmethod
    def _from_layout(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "schema_version" not in data:
            return data
        src = data.get("config_source_dir")
        fields = {"config": config_from_dict(data["config"], Path(src) if src else None),
                  "hardware": data["hardware"], "shape": ModelShape.from_dict(data["model"]["shape"]),
                  "candidates": data["candidates"], "notes": data.get("notes", [])}
        for key in ("files", "run"):
            if key in data:
                fields[key] = data[key]
        if data.get("chosen_candidate") is not None:
            fields["chosen"] = data["chosen_candidate"]
        return fields

    def to_dict(self) -> dict[str, Any]:
        """The plan as plan.json holds it."""
        return self.model_dump(mode="json")

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")
        tmp.replace(path)  # atomic: a reader never sees half a plan
        return path


class Refusal(PlanResult):
    """Nothing fits: every candidate, closest to fitting first (`orchestrate.planning.require_feasible` words why
    and what would fit)."""


class RunPlan(PlanResult):
    """A runnable plan: the chosen candidate (never None), and once the launcher wrote its run
    directory the files and the run section."""

    chosen: Candidate
    files: RunFiles = RunFiles()
    run: RunSection | None = None
    """Set when the plan belongs to a run directory (see RunSection)."""

    @property
    def strategy(self) -> Strategy:
        """The chosen candidate's strategy: what every rank trains with."""
        return self.chosen.strategy

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains on over every rank (micro-batch x accumulation x world x seq_len
        x the sequences of a sample: a preference pair's two)."""
        return self.config.sequences_per_sample * tokens_per_step(
            self.strategy, self.chosen.gradient_accumulation, self.world_size, self.config.train.seq_len)

    @classmethod
    def read(cls, path: Path, read_only: bool = False) -> RunPlan:
        """The plan in `path`; a UserError naming it for a missing, damaged or foreign file and for one
        that chose nothing. `read_only` (`report`, `chat`, `export`): a plan of another schema version is
        read as far as it goes; else (`--resume`) it is refused (`orchestrate.run.versions`)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise _unreadable(path, exc) from None
        check_plan_version(data, Path(path), read_only)
        if isinstance(data, dict) and data.get("chosen_candidate") is None:
            raise UserError(f"{path} is not a runnable plan", [Problem(
                str(path), "no feasible strategy was chosen (see `orchestrate plan`)",
                "plan the run again: `orchestrate launch CONFIG` (a new run directory)")])
        other = isinstance(data, dict) and data.get("schema_version") != PLAN_SCHEMA_VERSION
        try:
            return cls.model_validate(data)
        except UserError as exc:  # its config no longer validates
            if other:
                raise unreadable_other_version(path, data["schema_version"], exc.headline) from None
            raise UserError(f"the plan {path} cannot be used", exc.problems) from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if other:
                raise unreadable_other_version(path, data["schema_version"], f"{type(exc).__name__}: "
                                               f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
            raise _unreadable(path, exc) from None


def _unreadable(path: Path, exc: Exception) -> UserError:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return UserError(f"the plan {path} cannot be read", [Problem(
        str(path), f"{type(exc).__name__}: {first}",
        "restore it: every checkpoint keeps a copy (checkpoints/step-N/plan.json); or write a new run "
        "directory (--run-dir NEW)")])
