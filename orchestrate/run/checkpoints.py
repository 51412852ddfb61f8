"""The checkpoints of a run: their layout, their typed metadata and how they are found.

    RUN_DIR/checkpoints/
      latest                    "step-00000040": the newest complete checkpoint (replaced last)
      step-00000040/
        meta.json               CheckpointMeta: step, world size, strategy, model shape, sampler
        plan.json               the plan that wrote it
        config.json             the Hugging Face model config (for `orchestrate export`)
        ranks/rank-00000.json   per rank: RNG states and sampler state
        <engine files>          whatever the backend's engine writes
      .tmp-step-00000050/       a checkpoint being written (a crash leaves it; the next save removes it)

The write protocol is the workers' (`orchestrate.worker.checkpointing.Checkpointer`); reading is
shared by the workers, the launcher (`--resume`) and `orchestrate export`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.errors import Problem, UserError
from orchestrate.run.layout import PLAN_FILE

if TYPE_CHECKING:
    from orchestrate.planner.plan import Plan

CHECKPOINT_DIR = "checkpoints"  # the one name of this module listed in RUN_DIR (orchestrate.run)
LATEST_FILE = "latest"
META_FILE = "meta.json"
PLAN_COPY = PLAN_FILE
HF_CONFIG = "config.json"
RANKS_DIR = "ranks"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".old-"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CheckpointMeta:
    """meta.json: what resuming checks before anything is built, and what export needs."""

    format: int
    step: int
    world_size: int
    backend: str
    strategy: dict[str, Any]
    """`Strategy.to_dict()` of the plan that wrote it."""
    strategy_name: str
    gradient_accumulation: int
    model_shape: dict[str, Any]
    seq_len: int
    global_batch_size: int
    seed: int
    sampler: dict[str, Any]
    """The world-size independent sampler state (what a resharded resume continues from)."""
    saved_at: str
    torch_version: str

    @classmethod
    def of(cls, plan: Plan, step: int, world_size: int, sampler_state: dict[str, Any],
           torch_version: str) -> CheckpointMeta:
        strategy, train = plan.chosen.strategy, plan.config.train
        return cls(format=FORMAT_VERSION, step=step, world_size=world_size, backend=strategy.backend,
                   strategy=strategy.to_dict(), strategy_name=strategy.name,
                   gradient_accumulation=plan.chosen.gradient_accumulation, model_shape=plan.shape.to_dict(),
                   seq_len=train.seq_len, global_batch_size=train.global_batch_size, seed=train.seed,
                   sampler=sampler_state, saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   torch_version=torch_version)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "meta.json") -> CheckpointMeta:
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if not isinstance(data, dict) or n not in data]
        if missing:
            raise UserError("a checkpoint's metadata is incomplete", [Problem(
                where, f"missing {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}",
                "resume or export another checkpoint of the run (--step N), or delete this one")])
        return cls(**{n: data[n] for n in names})


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def read_meta(ckpt_dir: Path) -> CheckpointMeta:
    path = Path(ckpt_dir) / META_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError("a checkpoint's metadata cannot be read", [Problem(
            str(path), str(exc), "resume or export another checkpoint of the run (--step N), or delete this one")]
        ) from None
    return CheckpointMeta.from_dict(data, str(path))


def write_meta(ckpt_dir: Path, meta: CheckpointMeta) -> None:
    (Path(ckpt_dir) / META_FILE).write_text(json.dumps(meta.to_dict(), indent=1) + "\n")


def rank_file(ckpt_dir: Path, rank: int) -> Path:
    return Path(ckpt_dir) / RANKS_DIR / f"rank-{rank:05d}.json"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names, or None before the first one is complete."""
    root = checkpoint_root(run_dir)
    pointer = root / LATEST_FILE
    if not pointer.is_file():
        return None
    ckpt = root / pointer.read_text().strip()
    if not (ckpt / META_FILE).is_file():
        # Never written by the protocol above: someone removed or edited checkpoints by hand.
        raise UserError("the latest checkpoint is missing", [Problem(
            str(pointer), f"names {ckpt.name}, which has no {META_FILE}",
            f"point {pointer} at a complete step-* directory, or delete {pointer} to start from step 0")])
    return ckpt


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (renamed into place), oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / META_FILE).is_file())


def find_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The latest checkpoint, or the one of `step`; UserError when there is none."""
    if step is None:
        found = latest_checkpoint(run_dir)
        if found is None:
            raise UserError("no checkpoint to use", [Problem(
                str(run_dir), f"{checkpoint_root(run_dir)} has no complete checkpoint",
                "train with train.checkpoint_every > 0, or until the end (a checkpoint is written there)")])
        return found
    ckpt = checkpoint_root(run_dir) / step_dir_name(step)
    if not (ckpt / META_FILE).is_file():
        steps = ", ".join(str(read_meta(p).step) for p in list_checkpoints(run_dir)) or "none"
        raise UserError(f"no checkpoint of step {step}", [Problem(
            "--step", f"{run_dir} has checkpoints of steps: {steps}", "pick one of those")])
    return ckpt
