"""Atomic, resumable checkpoints of a run: the write protocol and the restore (the layout and the
metadata are the run-directory contract's, `orchestrate.run.checkpoints`). Per rank, ranks/ holds
the RNG states (torch CPU/CUDA, python, numpy) and the sampler state; the engine files are the
backend's (DeepSpeed: deepspeed/; FSDP2: DCP shards + engine_state.json; DDP: trainer_state.pt).

Write protocol (`Checkpointer.save`, collective): everything goes into `.tmp-step-N`; a barrier
waits for every rank; rank 0 checks that every rank's file is visible (a run directory that is not
one shared file system across nodes fails here, loudly), renames the directory into place, then
points `latest` at it with an atomic `os.replace`, then prunes all but the newest
`train.keep_checkpoints`. A crash at any point leaves `latest` naming a complete checkpoint (or
nothing). Files are not fsynced: atomic against process crashes, not against losing the machine.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from orchestrate.errors import Problem, UserError
from orchestrate.run.checkpoints import (
    HF_CONFIG,
    LATEST_FILE,
    PLAN_COPY,
    RANKS_DIR,
    TMP_PREFIX,
    TRASH_PREFIX,
    CheckpointMeta,
    checkpoint_root,
    list_checkpoints,
    rank_file,
    read_meta,
    step_dir_name,
    write_meta,
)

if TYPE_CHECKING:
    from orchestrate.backends.base import TrainEngine, WorkerContext
    from orchestrate.planner.plan import Plan


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


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


# --- the collective part -----------------------------------------------------------------------


class Checkpointer:
    """Saves and restores a TrainEngine plus everything else a bit-exact resume needs. Collective:
    every rank calls `save` / `load` at the same step."""

    def __init__(self, plan: Plan, engine: TrainEngine, ctx: WorkerContext):
        self.plan = plan
        self.engine = engine
        self.ctx = ctx
        self.root = checkpoint_root(ctx.run_dir)
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
        rank = self.ctx.rank
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # what a crash during an earlier save left
            (tmp / RANKS_DIR).mkdir(parents=True)
        self._barrier()
        _write_json(rank_file(tmp, rank), {"rank": rank, "step": step, "rng": rng_state(self.ctx.device),
                                            "sampler": sampler_state})
        self.engine.save_checkpoint(tmp, {"step": step})
        if rank == 0:
            write_meta(tmp, CheckpointMeta.of(self.plan, step, self.ctx.world_size, sampler_state, torch.__version__))
            _write_json(tmp / PLAN_COPY, self.plan.to_dict())
            shutil.copyfile(self.ctx.model_dir / HF_CONFIG, tmp / HF_CONFIG)
        self._barrier()  # every rank's files are written
        final = self.root / name
        if rank == 0:
            self._require_shared(tmp)
            _publish(tmp, final)
            _point_latest(self.root, name)
            self._prune(final)
        self._barrier()  # nobody goes on (or exits) before the checkpoint is published
        self.last_save_s = time.perf_counter() - start
        return final

    def _require_shared(self, tmp: Path) -> None:
        missing = [r for r in range(self.ctx.world_size) if not rank_file(tmp, r).is_file()]
        if missing:
            raise UserError("checkpoint files of other ranks are not visible on rank 0", [Problem(
                str(self.ctx.run_dir), f"ranks {missing[:8]} wrote their part of {tmp.name} where rank 0 cannot "
                "see it: the run directory is not on a file system shared by all nodes",
                "put train.output_dir (the run directory) on a shared file system (NFS, Lustre, ...)")])

    def _prune(self, newest: Path) -> None:
        complete = list_checkpoints(self.ctx.run_dir)
        for old in complete[: max(0, len(complete) - self.keep)]:
            if old != newest:
                _remove(old)
        # What crashed saves (.tmp-*) and interrupted deletions (.old-*) left behind.
        for leftover in [*self.root.glob(TMP_PREFIX + "*"), *self.root.glob(TRASH_PREFIX + "*")]:
            shutil.rmtree(leftover, ignore_errors=True)

    def load(self, ckpt_dir: Path) -> dict[str, Any]:
        """Restore engine, RNG and returns {"step", "sampler"} for the caller's sampler. The caller
        has run `check_resumable` already (before building the engine)."""
        meta = read_meta(ckpt_dir)
        client = self.engine.load_checkpoint(ckpt_dir)
        if int(client["step"]) != meta.step:
            raise RuntimeError(f"{ckpt_dir}: engine state is of step {client['step']}, meta.json says {meta.step}")
        step = meta.step
        if meta.world_size == self.ctx.world_size:
            own = json.loads(rank_file(ckpt_dir, self.ctx.rank).read_text())
            set_rng_state(own["rng"], self.ctx.device)
            sampler = own["sampler"]
        else:
            # The sampler's state is world-size independent; rank generators are not, so they restart.
            reseed(self.plan.config.train.seed, self.ctx.rank, step, self.ctx.device)
            sampler = meta.sampler
        self._barrier()
        return {"step": step, "sampler": sampler}


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished directory into place. A `final` already there is a stale copy (written
    before a crash, never named by `latest`, or the same step saved again): it goes first."""
    if final.exists():
        _remove(final)
    os.rename(tmp, final)


def _point_latest(root: Path, name: str) -> None:
    tmp = root / (LATEST_FILE + ".tmp")
    tmp.write_text(name + "\n")
    os.replace(tmp, root / LATEST_FILE)  # atomic: readers see the old or the new name, never half


def _remove(path: Path) -> None:
    """Delete a checkpoint directory; renamed out of sight first so a crash mid-way leaves no
    half-deleted step-* directory."""
    trash = path.with_name(TRASH_PREFIX + path.name)
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
