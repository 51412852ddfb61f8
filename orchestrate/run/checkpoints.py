"""The checkpoints of a run: their layout, their typed metadata and how they are found.

    RUN_DIR/checkpoints/
      latest                    "step-00000040": the last one published (a hint; discovery scans step-*)
      step-00000040/
        meta.json               CheckpointMeta: step, world size, strategy, model shape, sampler
        plan.json               the plan that wrote it
        config.json             the Hugging Face model config (for `orchestrate export`)
        ranks/rank-00000.json   per rank: RNG states and sampler state
        ranks/objective-00000.pt  per rank, of an objective that keeps state between steps (GRPO's rollouts
                                within a num_iterations cycle): its state_dict, torch.save (weights-only)
        <engine files>          whatever the backend's engine writes
        manifest.json           every other file's size and checksum, written last (`write_manifest`)
      .tmp-step-00000050/       a checkpoint being written (a crash leaves it; the next save removes it)

The write protocol is the workers' (`orchestrate.worker.checkpointing.Checkpointer`); reading is
shared by the workers, the launcher (`--resume`) and `orchestrate export`. Readers do not trust
`latest`: they scan the step-* directories newest first and take the first intact one (meta.json,
every rank file and the manifest check out), naming each newer damaged one they skip.

A checkpoint's completeness manifest: `manifest.json`, written last into the checkpoint directory
(by rank 0 after every rank's files are written, before the rename into place), listing every
other file with its size and checksum. A checkpoint without one was written before manifests
existed ("unverified"); one whose files differ from it is damaged.

Checksum: xxHash's XXH3-128 (the `xxhash` package, a dependency: an order of magnitude faster than
hashlib's sha256, docs/measurements.md#runcheckpointspy); a manifest naming
another hashlib algorithm is verified with it. It guards against truncation, partial overwrites and
bit rot, not against tampering.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from orchestrate.errors import Problem, UserError
from orchestrate.run.layout import PLAN_FILE
from orchestrate.run.writes import write_file

if TYPE_CHECKING:
    from orchestrate.planner.plan import RunPlan


CHECKPOINT_DIR = "checkpoints"  # the one name of this module listed in RUN_DIR (orchestrate.run)
LATEST_FILE = "latest"
META_FILE = "meta.json"
PLAN_COPY = PLAN_FILE
HF_CONFIG = "config.json"
RANKS_DIR = "ranks"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".old-"
DAMAGED_PREFIX = "damaged-"
"""A damaged step-N that a new save of step N replaced is kept under this name for you to look at."""
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
    def of(cls, plan: RunPlan, step: int, world_size: int, sampler_state: dict[str, Any],
           torch_version: str) -> CheckpointMeta:
        strategy, train = plan.strategy, plan.config.train
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


def engine_errors() -> tuple[type[BaseException], ...]:
    """What writing or reading engine files can raise: any Exception, and DCP's
    CheckpointException, which derives from BaseException (torch/distributed/checkpoint/api.py)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


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


def run_dir_of(ckpt_dir: Path) -> Path:
    """The run directory a checkpoint directory (RUN_DIR/checkpoints/<name>) belongs to."""
    return Path(ckpt_dir).parent.parent


def write_meta(ckpt_dir: Path, meta: CheckpointMeta) -> None:
    write_file(run_dir_of(ckpt_dir), Path(ckpt_dir) / META_FILE, json.dumps(meta.to_dict(), indent=1) + "\n")


def rank_file(ckpt_dir: Path, rank: int) -> Path:
    return Path(ckpt_dir) / RANKS_DIR / f"rank-{rank:05d}.json"


def objective_file(ckpt_dir: Path, rank: int) -> Path:
    """A rank's objective state (backends/base.py `StatefulObjective`); absent in a checkpoint written
    before objectives kept state, or of an objective that keeps none."""
    return Path(ckpt_dir) / RANKS_DIR / f"objective-{rank:05d}.pt"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names when it has a meta.json (None otherwise). Only a hint, e.g. for
    what was saved last: resuming and exporting discover checkpoints (`newest_checkpoint`)."""
    pointer = checkpoint_root(run_dir) / LATEST_FILE
    if not pointer.is_file():
        return None
    ckpt = checkpoint_root(run_dir) / pointer.read_text().strip()
    return ckpt if ckpt.name.startswith("step-") and (ckpt / META_FILE).is_file() else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Every step-* directory (renamed into place, intact or not: see `inspect_checkpoint`), oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir())


@dataclass(frozen=True)
class CheckpointStatus:
    path: Path
    meta: CheckpointMeta | None
    problem: str | None
    """Why it cannot be used (None: it can)."""
    verified: bool
    """It has a manifest and matches it (False for a checkpoint written before manifests existed)."""

    @property
    def intact(self) -> bool:
        return self.problem is None


def inspect_checkpoint(ckpt: Path, full: bool = True) -> CheckpointStatus:
    """Is `ckpt` complete? Its meta.json, every rank file of its world size, and its manifest
    (sizes; checksums too with `full`)."""
    try:
        meta = read_meta(ckpt)
    except UserError as exc:
        return CheckpointStatus(ckpt, None, "; ".join(p.message for p in exc.problems) or str(exc), False)
    for rank in range(meta.world_size):
        try:
            json.loads(rank_file(ckpt, rank).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            return CheckpointStatus(ckpt, meta, f"{RANKS_DIR}/{rank_file(ckpt, rank).name} cannot be read "
                                    f"({type(exc).__name__}: {exc})", False)
    if not has_manifest(ckpt):
        return CheckpointStatus(ckpt, meta, None, False)
    return CheckpointStatus(ckpt, meta, manifest_problem(ckpt, full), True)


@dataclass(frozen=True)
class Discovery:
    """The checkpoint to use, and the newer ones skipped because they are damaged."""

    chosen: CheckpointStatus | None
    skipped: list[CheckpointStatus]

    def notices(self) -> list[str]:
        lines = [f"checkpoint {s.path} is damaged, skipped: {s.problem}" for s in self.skipped]
        if self.chosen is not None and self.skipped:
            lines.append(f"falling back to {self.chosen.path.name}, the newest intact checkpoint")
        if self.chosen is not None and not self.chosen.verified:
            lines.append(f"{self.chosen.path} has no {MANIFEST_FILE} (written before checkpoints had one): "
                         "it is used unverified")
        return lines


_SCANS = 5
"""Rescans when checkpoints vanish while they are inspected (a run still training prunes them)."""


def _statuses(run_dir: Path, full: bool) -> list[CheckpointStatus]:
    """Every step-* checkpoint, newest first. One without a manifest that is newer than one with a
    manifest was not written by this protocol's end (the manifest goes in before the rename). A
    checkpoint that is gone once inspected was pruned by a run that is still training (an export or
    a resume of a running run), not damaged: the scan starts again and sees what replaced it."""
    for _ in range(_SCANS):
        statuses = [inspect_checkpoint(ckpt, full) for ckpt in reversed(list_checkpoints(run_dir))]
        if all(s.path.is_dir() for s in statuses):
            break
    statuses = [s for s in statuses if s.path.is_dir()]
    for i, s in enumerate(statuses):
        if s.intact and not s.verified and any(o.verified for o in statuses[i + 1:]):
            statuses[i] = CheckpointStatus(s.path, s.meta, f"no {MANIFEST_FILE} although older checkpoints have "
                                           "one: its write did not finish or the manifest was removed", False)
    return statuses


def _none_intact(run_dir: Path, statuses: list[CheckpointStatus]) -> UserError:
    return UserError("no intact checkpoint", [
        Problem(str(s.path), s.problem or "", "restore it from a copy, or move it out of "
                f"{checkpoint_root(run_dir)} (training then starts from step 0)") for s in statuses])


def newest_checkpoint(run_dir: Path, full: bool = True) -> Discovery:
    """The newest intact checkpoint (chosen None when the run has no step-* checkpoint at all);
    UserError when there are checkpoints but none is intact: starting from step 0 would replace them."""
    statuses = _statuses(run_dir, full)
    for i, status in enumerate(statuses):
        if status.intact:
            return Discovery(status, statuses[:i])
    if statuses:
        raise _none_intact(run_dir, statuses)
    return Discovery(None, [])


def find_checkpoint(run_dir: Path, step: int | None = None, full: bool = True) -> Discovery:
    """The newest intact checkpoint, or the one of `step`; UserError when there is none."""
    if step is None:
        found = newest_checkpoint(run_dir, full)
        if found.chosen is None:
            raise UserError("no checkpoint to use", [Problem(
                str(run_dir), f"{checkpoint_root(run_dir)} has no complete checkpoint",
                "train with train.checkpoint_every > 0, or until the end (a checkpoint is written there)")])
        return found
    statuses = _statuses(run_dir, full)
    intact = ", ".join(str(s.meta.step) for s in reversed(statuses) if s.intact) or "none"
    wanted = [s for s in statuses if s.path.name == step_dir_name(step)]
    if not wanted:
        raise UserError(f"no checkpoint of step {step}", [Problem(
            "--step", f"{run_dir} has intact checkpoints of steps: {intact}", "pick one of those")])
    if not wanted[0].intact:
        raise UserError(f"the checkpoint of step {step} is damaged", [Problem(
            str(wanted[0].path), wanted[0].problem or "", f"pick another --step (intact: {intact})")])
    return Discovery(wanted[0], [])


MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 8 << 20
DEFAULT_ALGORITHM = "xxh3_128"


def _hasher(algorithm: str) -> Any:
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    return hashlib.new(algorithm)


def file_digest(path: Path, algorithm: str) -> str:
    h = _hasher(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(ckpt_dir: Path) -> list[Path]:
    return sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.relative_to(ckpt_dir).as_posix() != MANIFEST_FILE)


def write_manifest(ckpt_dir: Path, algorithm: str | None = None) -> dict[str, Any]:
    """Checksum every file of `ckpt_dir` and write the manifest (the directory's last file)."""
    ckpt_dir = Path(ckpt_dir)
    algorithm = algorithm or DEFAULT_ALGORITHM
    files = {p.relative_to(ckpt_dir).as_posix(): {"size": p.stat().st_size, "hash": file_digest(p, algorithm)}
             for p in _files(ckpt_dir)}
    manifest = {"format": MANIFEST_FORMAT, "algorithm": algorithm, "files": files,
                "bytes": sum(f["size"] for f in files.values())}
    write_file(run_dir_of(ckpt_dir), ckpt_dir / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")
    return manifest


def has_manifest(ckpt_dir: Path) -> bool:
    return (Path(ckpt_dir) / MANIFEST_FILE).is_file()


def manifest_problem(ckpt_dir: Path, full: bool = True) -> str | None:
    """Why `ckpt_dir` does not match its manifest (None: it does). `full=False` compares sizes only
    (a stat per file); `full` also recomputes every checksum (reads every byte)."""
    ckpt_dir = Path(ckpt_dir)
    try:
        manifest = json.loads((ckpt_dir / MANIFEST_FILE).read_text())
        files, algorithm = manifest["files"], manifest["algorithm"]
        _hasher(algorithm)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, ImportError) as exc:
        return f"{MANIFEST_FILE} cannot be read ({type(exc).__name__}: {exc})"
    for rel, want in files.items():
        path = ckpt_dir / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{rel} has {size:,} bytes, the manifest says {want['size']:,} (truncated or overwritten)"
    if full:
        for rel, want in files.items():
            if file_digest(ckpt_dir / rel, algorithm) != want["hash"]:
                return f"{rel} does not match its {algorithm} checksum (its contents changed after the write)"
    return None
