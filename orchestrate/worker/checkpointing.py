"""Atomic, resumable checkpoints of a run: the write protocol and the restore (the layout and the
metadata are the run-directory contract's, `orchestrate.run.checkpoints`). Per rank, ranks/ holds
the RNG states (torch CPU/CUDA, python, numpy) and the sampler state, and the objective's state where
it keeps one between steps (backends/base.py `StatefulObjective`); the engine files are the
backend's (DeepSpeed: deepspeed/; FSDP2: DCP shards + engine_state.json; DDP: trainer_state.pt).

Write protocol (`Checkpointer.save`, collective): everything goes into `.tmp-step-N`; a barrier
waits for every rank; rank 0 checks that every rank's file is visible (a run directory that is not
one shared file system across nodes fails here, loudly), writes manifest.json (every file's size
and checksum) last, renames the directory into place, then points `latest` at it with an atomic
`os.replace`, then prunes (never an intact checkpoint unless `train.keep_checkpoints` newer intact
ones remain). A crash at any point leaves every earlier checkpoint in place; a file-system error
(disk full) removes the partial directory and is a UserError naming the checkpoint kept. Files
are not fsynced: atomic against process crashes, not against losing the machine.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from orchestrate.backends.base import stateful_objective
from orchestrate.errors import Problem, UserError
from orchestrate.run.checkpoints import (
    DAMAGED_PREFIX,
    HF_CONFIG,
    LATEST_FILE,
    PLAN_COPY,
    RANKS_DIR,
    TMP_PREFIX,
    TRASH_PREFIX,
    CheckpointMeta,
    CheckpointStatus,
    checkpoint_root,
    engine_errors,
    inspect_checkpoint,
    list_checkpoints,
    newest_checkpoint,
    objective_file,
    rank_file,
    read_meta,
    step_dir_name,
    write_manifest,
    write_meta,
)
from orchestrate.run.writes import refuse_links_in, refuse_links_on, write_file

if TYPE_CHECKING:
    from orchestrate.backends.base import TrainEngine
    from orchestrate.backends.rank import Rank
    from orchestrate.planner.plan import RunPlan


# --- per-rank state ----------------------------------------------------------------------------


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every random generator a step may draw from, as JSON (nothing to unpickle on load)."""
    import numpy as np

    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": _b64(torch.get_rng_state()),
        "python": [version, list(internal), gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
    }
    if device.type == "cuda":
        state["cuda"] = _b64(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    import numpy as np

    torch.set_rng_state(_unb64(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_unb64(state["cuda"]), device)


def reseed(seed: int, rank: int, step: int, device: torch.device) -> None:
    """Fresh, reproducible generators for a rank whose saved state does not exist (new world size)."""
    import numpy as np

    value = (seed * 1_000_003 + step) * 4099 + rank
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value % 2**32)
    if device.type == "cuda":
        torch.cuda.manual_seed(value)


def _write_json(run_dir: Path, path: Path, data: Any) -> None:
    write_file(run_dir, path, json.dumps(data, indent=1) + "\n")


# --- the collective part -----------------------------------------------------------------------


class Checkpointer:
    """Saves and restores a TrainEngine plus everything else a bit-exact resume needs. Collective:
    every rank calls `save` / `load` at the same step."""

    def __init__(self, plan: RunPlan, engine: TrainEngine, rank: Rank, run_dir: Path, model_dir: Path):
        self.plan = plan
        self.engine = engine
        self.rank = rank
        self.run_dir = run_dir
        """Where the checkpoints go (RUN_DIR, or your own loop's directory)."""
        self.model_dir = model_dir
        """The initial model directory: its config.json goes into every checkpoint (for export)."""
        self.root = checkpoint_root(run_dir)
        self.keep = plan.config.train.keep_checkpoints
        self.last_save_s: float | None = None
        """Wall time of the last save on this rank (what a preemption's grace period is weighed against)."""

    def _barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()

    def save(self, step: int, sampler_state: dict[str, Any]) -> Path:
        start = time.perf_counter()
        name = step_dir_name(step)
        tmp = self.root / (TMP_PREFIX + name)
        rank = self.rank.rank
        try:
            self._write(step, tmp, sampler_state)
        except engine_errors() as exc:  # only an OSError inside it becomes a UserError
            raise self._write_failed(step, tmp, exc) from exc
        self._barrier()  # every rank's files are written
        final = self.root / name
        if rank == 0:
            self._require_shared(tmp)
            try:
                write_manifest(tmp)  # last: a directory with a manifest is complete
            except OSError as exc:
                raise self._write_failed(step, tmp, exc) from exc
            refuse_links_in(self.run_dir, tmp)  # a link placed in it while the engine wrote
            refuse_links_on(self.run_dir, final)
            _publish(tmp, final)
            _point_latest(self.run_dir, name)
            self._prune()
        self._barrier()  # nobody goes on (or exits) before the checkpoint is published
        self.last_save_s = time.perf_counter() - start
        return final

    def _write(self, step: int, tmp: Path, sampler_state: dict[str, Any]) -> None:
        rank = self.rank.rank
        if rank == 0:
            refuse_links_on(self.run_dir, tmp)  # RUN_DIR/checkpoints linked elsewhere while the run trained
            shutil.rmtree(tmp, ignore_errors=True)  # what a crash during an earlier save left
            (tmp / RANKS_DIR).mkdir(parents=True)
        self._barrier()
        _write_json(self.run_dir, rank_file(tmp, rank), {"rank": rank, "step": step, "rng": rng_state(self.rank.device),
                                            "sampler": sampler_state})
        if (objective := stateful_objective(self.engine)) is not None:
            torch.save(objective.state_dict(), objective_file(tmp, rank))  # in ranks/, checked for links above
        self.engine.save_checkpoint(tmp, {"step": step})
        if rank == 0:
            write_meta(tmp, CheckpointMeta.of(self.plan, step, self.rank.world_size, sampler_state, torch.__version__))
            _write_json(self.run_dir, tmp / PLAN_COPY, self.plan.to_dict())
            if (self.model_dir / HF_CONFIG).is_file():  # a user's own module (orchestrate.prepare) has none
                shutil.copyfile(self.model_dir / HF_CONFIG, tmp / HF_CONFIG)

    def _write_failed(self, step: int, tmp: Path, exc: BaseException) -> BaseException:
        """A write that failed on the file system (disk full, quota, permissions) becomes a
        UserError naming the checkpoint that is kept; anything else propagates unchanged. The
        partial directory goes first: on a full disk that makes room for this very message in
        the logs (which are on the same disk)."""
        error = _os_error(exc, tmp)
        if error is None:
            return exc
        shutil.rmtree(tmp, ignore_errors=True)
        kept = newest_intact(self.run_dir)
        what = "no space left on device" if error.errno in (errno.ENOSPC, errno.EDQUOT) else error.strerror
        keeps = (f"the previous checkpoint {kept.path} (step {kept.meta.step}) is kept, intact: --resume continues "
                 "from it" if kept else "there is no earlier checkpoint to resume from")
        return UserError(f"the checkpoint of step {step} could not be written: {what}", [Problem(
            str(self.root), f"{error}; the partial {tmp.name} was removed and {keeps}",
            f"free space where {self.run_dir} is (df -h {self.root}) or lower train.keep_checkpoints, then "
            f"`orchestrate launch CONFIG --resume --run-dir {self.run_dir}`")])

    def _require_shared(self, tmp: Path) -> None:
        missing = [r for r in range(self.rank.world_size) if not rank_file(tmp, r).is_file()]
        if missing:
            raise UserError("checkpoint files of other ranks are not visible on rank 0", [Problem(
                str(self.run_dir), f"ranks {missing[:8]} wrote their part of {tmp.name} where rank 0 cannot "
                "see it: the run directory is not on a file system shared by all nodes",
                "put train.output_dir (the run directory) on a shared file system (NFS, Lustre, ...)")])

    def _prune(self) -> None:
        """Keep the newest `train.keep_checkpoints` intact checkpoints and whatever is newer than
        the oldest of them (damaged ones are left for the user to look at); delete only what is
        older. Sizes are checked, not checksums: the newest was checksummed a moment ago."""
        intact = 0
        for ckpt in reversed(list_checkpoints(self.run_dir)):
            if intact >= self.keep:
                _remove(ckpt)
            else:
                status = inspect_checkpoint(ckpt, full=False)
                intact += status.verified and status.intact
        # What crashed saves (.tmp-*) and interrupted deletions (.old-*) left behind.
        for leftover in [*self.root.glob(TMP_PREFIX + "*"), *self.root.glob(TRASH_PREFIX + "*")]:
            shutil.rmtree(leftover, ignore_errors=True)

    def load(self, ckpt_dir: Path) -> dict[str, Any]:
        """Restore engine, RNG and returns {"step", "sampler"} for the caller's sampler. The caller
        has run `check_resumable` already (before building the engine). A checkpoint that passed
        verification and still fails to load (the engine raising) is a UserError naming it."""
        meta = read_meta(ckpt_dir)
        try:
            client = self.engine.load_checkpoint(ckpt_dir)
            own = json.loads(rank_file(ckpt_dir, self.rank.rank).read_text()) if meta.world_size == self.rank.world_size \
                else None
        except engine_errors() as exc:  # the boundary: whatever the engine raises
            raise _unloadable(ckpt_dir, f"{type(exc).__name__}: {exc}") from exc
        if int(client.get("step", -1)) != meta.step:
            raise _unloadable(ckpt_dir, f"the engine state is of step {client.get('step')}, meta.json says {meta.step}")
        if own is not None:
            set_rng_state(own["rng"], self.rank.device)
            sampler = own["sampler"]
            self._load_objective(ckpt_dir)
        else:
            # The sampler's state is world-size independent; rank generators are not, so they restart.
            reseed(self.plan.config.train.seed, self.rank.rank, meta.step, self.rank.device)
            sampler = meta.sampler
        self._barrier()
        return {"step": meta.step, "sampler": sampler}

    def _load_objective(self, ckpt_dir: Path) -> None:
        """The objective's state of this rank, where the objective keeps one and the checkpoint holds it
        (one written before objectives kept state does not: the objective goes on without it)."""
        objective, path = stateful_objective(self.engine), objective_file(ckpt_dir, self.rank.rank)
        if objective is None or not path.is_file():
            return
        try:
            state = torch.load(path, map_location=self.rank.device, weights_only=True)
        except engine_errors() as exc:
            raise _unloadable(ckpt_dir, f"{path.name}: {type(exc).__name__}: {exc}") from exc
        objective.load_state_dict(state)


def newest_intact(run_dir: Path) -> CheckpointStatus | None:
    """The newest intact checkpoint by sizes (None: none), for messages."""
    try:
        return newest_checkpoint(run_dir, full=False).chosen
    except UserError:
        return None


def _unloadable(ckpt_dir: Path, why: str) -> UserError:
    step = ckpt_dir.name.removeprefix("step-").lstrip("0") or "0"
    return UserError(f"the checkpoint {ckpt_dir} passed its checks but cannot be loaded", [Problem(
        str(ckpt_dir), why, f"export an older one with `orchestrate export RUN_DIR --step N`, or move {ckpt_dir.name} "
        f"out of {ckpt_dir.parent} and --resume again (it continues from the newest older intact one; this "
        f"was step {step})")])


_TORCH_WRITE_FAILED = ("PytorchStreamWriter failed", "inline_container.cc", "iostream error", "file write failed")
"""How torch.save(obj, path) fails when the file system refuses a write: a RuntimeError from its C++
zip writer, without the errno (`torch.save(x, "/dev/full")`: "[enforce fail at inline_container.cc:672]
. unexpected pos ..." with "basic_ios::clear: iostream error" as its context). DeepSpeed and DDP's
trainer_state.pt save that way."""
_NEARLY_FULL = 64 * 2**20


def _os_error(exc: BaseException | None, written: Path | None = None) -> OSError | None:
    """The OSError behind `exc`: itself, its cause or context, one of a DCP CheckpointException's
    per-rank failures (each an `(exception, traceback summary)` pair, torch/distributed/checkpoint/
    api.py), or torch.save's writer failing (`_TORCH_WRITE_FAILED`). That one carries no errno: the
    file system of `written` with under 64 MiB free (the partial checkpoint still on it) is ENOSPC,
    anything else EIO."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError):
            return exc
        failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        for failure in failures.values() if isinstance(failures, dict) else ():
            if isinstance(failure, tuple) and failure:
                failure = failure[0]
            found = _os_error(failure, written) if isinstance(failure, BaseException) else None
            if found is not None:
                return found
        if isinstance(exc, RuntimeError) and any(s in str(exc) for s in _TORCH_WRITE_FAILED):
            return OSError(_write_errno(written), f"{os.strerror(_write_errno(written))} (torch.save: {exc})")
        exc = exc.__cause__ or exc.__context__
    return None


def _write_errno(written: Path | None) -> int:
    try:
        full = written is not None and shutil.disk_usage(written if written.exists() else written.parent).free < _NEARLY_FULL
    except OSError:
        full = False
    return errno.ENOSPC if full else errno.EIO


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished directory into place. A `final` already there is one the resume skipped
    as damaged (discovery takes the newest intact one, so an intact step N is never saved again):
    it may hold intact weights (only its manifest lost, say), so it is moved aside to
    `damaged-step-N`, not deleted, and said so."""
    if final.exists():
        aside = final.with_name(DAMAGED_PREFIX + final.name)
        n = 1
        while aside.exists():
            n += 1
            aside = final.with_name(f"{DAMAGED_PREFIX}{final.name}-{n}")
        os.rename(final, aside)
        print(f"orchestrate: {final} was there already (skipped as damaged when the run resumed): kept as "
              f"{aside.name} for you to look at or delete; the new save of that step replaces it", flush=True)
    os.rename(tmp, final)


def _point_latest(run_dir: Path, name: str) -> None:
    write_file(run_dir, checkpoint_root(run_dir) / LATEST_FILE, name + "\n")  # whole: the old or the new name, never half


def _remove(path: Path) -> None:
    """Delete a checkpoint directory; renamed out of sight first so a crash mid-way leaves no
    half-deleted step-* directory."""
    trash = path.with_name(TRASH_PREFIX + path.name)
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
