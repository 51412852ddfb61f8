"""Atomic, resumable checkpoints of a run: layout, write protocol, resume checks and restore.

    RUN_DIR/checkpoints/
      latest                    "step-00000040": the newest complete checkpoint (replaced last)
      step-00000040/
        meta.json               step, world size, strategy, model shape, sampler (what resume checks)
        plan.json               the plan that wrote it
        config.json             the Hugging Face model config (for `orchestrate export`)
        ranks/rank-00000.json   per rank: RNG states (torch CPU/CUDA, python, numpy) and sampler state
        <engine files>          DeepSpeed: deepspeed/ (engine.save_checkpoint); FSDP2: DCP shards
                                (*.distcp, .metadata) + engine_state.json; DDP: trainer_state.pt
      .tmp-step-00000050/       a checkpoint being written (a crash leaves it; the next save removes it)

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

if TYPE_CHECKING:
    from orchestrate.backends.base import TrainEngine, WorkerContext
    from orchestrate.planner.plan import Plan

CHECKPOINT_DIR = "checkpoints"
LATEST_FILE = "latest"
META_FILE = "meta.json"
PLAN_COPY = "plan.json"
HF_CONFIG = "config.json"
RANKS_DIR = "ranks"
FORMAT_VERSION = 1
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".old-"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def read_meta(ckpt_dir: Path) -> dict[str, Any]:
    return json.loads((Path(ckpt_dir) / META_FILE).read_text())


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
        steps = ", ".join(str(read_meta(p)["step"]) for p in list_checkpoints(run_dir)) or "none"
        raise UserError(f"no checkpoint of step {step}", [Problem(
            "--step", f"{run_dir} has checkpoints of steps: {steps}", "pick one of those")])
    return ckpt


# --- what must match to resume ------------------------------------------------------------------


def make_meta(plan: Plan, step: int, world_size: int, sampler_state: dict[str, Any]) -> dict[str, Any]:
    strategy, train = plan.chosen.strategy, plan.config.train
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "backend": strategy.backend,
        "strategy": strategy.to_dict(),
        "strategy_name": strategy.name,
        "gradient_accumulation": plan.chosen.gradient_accumulation,
        "model_shape": plan.shape.to_dict(),
        "seq_len": train.seq_len,
        "global_batch_size": train.global_batch_size,
        "seed": train.seed,
        "sampler": sampler_state,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_version": torch.__version__,
    }


def resume_problems(meta: dict[str, Any], plan: Plan) -> list[Problem]:
    """Why the checkpoint described by `meta` cannot continue under `plan` (empty: it can).
    World size may differ: FSDP2's DCP and DDP's full state reshard natively, DeepSpeed ZeRO goes
    through a universal checkpoint (see DeepSpeedTrainEngine.load_checkpoint)."""
    problems = []
    if meta.get("format") != FORMAT_VERSION:
        problems.append(Problem("checkpoint", f"format {meta.get('format')} is not this version's {FORMAT_VERSION}",
                                "resume it with the orchestrate version that wrote it"))
    export_fix = ("or `orchestrate export RUN_DIR --out DIR` and start a new run from it "
                  "(model.name_or_path: DIR)")
    shape = plan.shape.to_dict()
    diff = [f"{k} {meta['model_shape'].get(k)} -> {v}" for k, v in shape.items() if meta["model_shape"].get(k) != v]
    if diff:
        problems.append(Problem("model", "the model differs from the checkpoint's: " + ", ".join(diff),
                                "resume with the model the checkpoint was trained with"))
    strategy = plan.chosen.strategy
    saved = meta["strategy"]
    if saved["backend"] != strategy.backend:
        problems.append(Problem("strategy.backend", f"the checkpoint was written by {saved['backend']}, this plan "
                                f"uses {strategy.backend}; optimizer states do not convert across backends",
                                f"set strategy.backend: {saved['backend']}, {export_fix}"))
    elif strategy.backend == "deepspeed" and saved["zero_stage"] != strategy.zero_stage:
        problems.append(Problem("strategy.zero_stage", f"the checkpoint is ZeRO stage {saved['zero_stage']}, this "
                                f"plan uses stage {strategy.zero_stage}",
                                f"set strategy.zero_stage: {saved['zero_stage']}, {export_fix}"))
    if saved["precision"] != strategy.precision:
        problems.append(Problem("train.precision", f"the checkpoint trained in {saved['precision']}, this plan in "
                                f"{strategy.precision}", f"set train.precision: {saved['precision']}, {export_fix}"))
    train = plan.config.train
    if meta["step"] > train.max_steps:
        problems.append(Problem("train.max_steps", f"{train.max_steps} is before the checkpoint's step {meta['step']}",
                                f"set train.max_steps to at least {meta['step']}, or export that checkpoint"))
    for key, now in (("seq_len", train.seq_len), ("global_batch_size", train.global_batch_size)):
        if meta[key] != now:
            problems.append(Problem(f"train.{key}", f"the checkpoint used {meta[key]}, this plan {now}: the data "
                                    "position and step count would mean something else",
                                    f"set train.{key}: {meta[key]}, {export_fix}"))
    return problems


def check_resumable(ckpt_dir: Path, plan: Plan) -> dict[str, Any]:
    """The checkpoint's meta.json; UserError naming every difference that prevents resuming."""
    meta = read_meta(ckpt_dir)
    problems = resume_problems(meta, plan)
    if problems:
        raise UserError(f"cannot resume from {ckpt_dir}", problems)
    return meta


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


def _rank_file(ckpt_dir: Path, rank: int) -> Path:
    return Path(ckpt_dir) / RANKS_DIR / f"rank-{rank:05d}.json"


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
        tmp = self.root / (_TMP_PREFIX + name)
        rank = self.ctx.rank
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # what a crash during an earlier save left
            (tmp / RANKS_DIR).mkdir(parents=True)
        self._barrier()
        _write_json(_rank_file(tmp, rank), {"rank": rank, "step": step, "rng": rng_state(self.ctx.device),
                                            "sampler": sampler_state})
        self.engine.save_checkpoint(tmp, {"step": step})
        if rank == 0:
            _write_json(tmp / META_FILE, make_meta(self.plan, step, self.ctx.world_size, sampler_state))
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
        missing = [r for r in range(self.ctx.world_size) if not _rank_file(tmp, r).is_file()]
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
        for leftover in [*self.root.glob(_TMP_PREFIX + "*"), *self.root.glob(_TRASH_PREFIX + "*")]:
            shutil.rmtree(leftover, ignore_errors=True)

    def load(self, ckpt_dir: Path) -> dict[str, Any]:
        """Restore engine, RNG and returns {"step", "sampler"} for the caller's sampler. The caller
        has run `check_resumable` already (before building the engine)."""
        meta = read_meta(ckpt_dir)
        client = self.engine.load_checkpoint(ckpt_dir)
        if int(client["step"]) != int(meta["step"]):
            raise RuntimeError(f"{ckpt_dir}: engine state is of step {client['step']}, meta.json says {meta['step']}")
        step = int(meta["step"])
        if meta["world_size"] == self.ctx.world_size:
            own = json.loads(_rank_file(ckpt_dir, self.ctx.rank).read_text())
            set_rng_state(own["rng"], self.ctx.device)
            sampler = own["sampler"]
        else:
            # The sampler's state is world-size independent; rank generators are not, so they restart.
            reseed(self.plan.config.train.seed, self.ctx.rank, step, self.ctx.device)
            sampler = meta["sampler"]
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
    trash = path.with_name(_TRASH_PREFIX + path.name)
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
