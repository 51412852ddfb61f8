"""distill.placement precomputed: a first pass writes the teacher's top-k logits of every training
sample the run will read into memory-mapped .npy files under RUN_DIR/teacher_cache, then training
reads them (the teacher is freed before the student is built, so the two never share memory). The
samples read are known before step 1: the first max_steps x global_batch_size positions of the
sampler's seeded stream (TrainData.blocks_read); a run shorter than an epoch pays for its own
samples only, not for the whole dataset's.

The cache is content-addressed: a sample's row is found by a digest of its input ids (and
attention mask), not by its position, so the data order, the world size and resuming change
nothing; identical samples have identical teacher logits anyway. Each rank computes a strided
share of the rows into the shared files; a JSON marker written last makes a complete cache
(a resumed run reuses it; an interrupted pass, or another teacher, is redone).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from orchestrate.methods.distill.teacher import teacher_dir
from orchestrate.run.layout import TEACHER_CACHE_DIR

if TYPE_CHECKING:
    import torch

    from orchestrate.data.pipeline import TrainData
    from orchestrate.planner.plan import RunPlan

_VALUES, _IDS, _DONE = "values.npy", "ids.npy", "complete.json"


def _digest(batch: dict[str, torch.Tensor], row: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for key in ("input_ids", "attention_mask"):
        if key in batch:
            h.update(batch[key][row].cpu().numpy().astype(np.int64).tobytes())
    return h.digest()


def _expected(plan: RunPlan, data: TrainData, blocks: np.ndarray) -> dict:
    """What a complete cache must have been made from: the samples' shape and how many of the stream
    the run reads (a longer run resumed needs more rows), top_k, and the teacher's weight files by
    name, size and modification time (a teacher retrained in place invalidates the cache; resuming
    with the same teacher reuses it)."""
    weights = sorted(teacher_dir(plan.config).glob("*.safetensors"))
    return {"rows": int(data.train.shape[0]), "read": len(blocks),
            "seq_len": plan.config.train.seq_len, "top_k": plan.config.distill.top_k,
            "teacher": plan.config.distill.teacher,
            "weights": [[w.name, w.stat().st_size, w.stat().st_mtime_ns] for w in weights]}


def write_cache(plan: RunPlan, run_dir: Path, data: TrainData, teacher: torch.nn.Module, device: torch.device,
                rank: int, world_size: int) -> None:
    """The first pass (collective): every rank writes rows rank, rank + world, ... ; all ranks run
    the same number of forwards (a sharded teacher gathers its blocks with every rank)."""
    import torch
    import torch.distributed as dist
    from numpy.lib.format import open_memmap

    root = Path(run_dir) / TEACHER_CACHE_DIR
    blocks = data.blocks_read(plan.config.train)  # the cache's rows, in order
    expected = _expected(plan, data, blocks)
    if (root / _DONE).is_file() and json.loads((root / _DONE).read_text()) == expected:
        return
    shape = (len(blocks), expected["seq_len"], expected["top_k"])
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        (root / _DONE).unlink(missing_ok=True)
        open_memmap(root / _VALUES, mode="w+", dtype=np.float32, shape=shape).flush()
        open_memmap(root / _IDS, mode="w+", dtype=np.int32, shape=shape).flush()
    dist.barrier()
    values, ids = open_memmap(root / _VALUES, mode="r+"), open_memmap(root / _IDS, mode="r+")
    rows = list(range(rank, len(blocks), world_size))
    step = plan.strategy.micro_batch_size
    with torch.no_grad():
        for start in range(0, -(-len(blocks) // world_size), step):
            chunk = rows[start:start + step]
            batch = {k: v.to(device) for k, v in data.train.batch([int(blocks[r]) for r in chunk or [0]]).items()
                     if k in ("input_ids", "attention_mask")}
            top = teacher(**batch, use_cache=False).logits.float().topk(expected["top_k"], dim=-1)
            if chunk:  # else this rank is out of rows and only joined the others' gathers
                values[chunk] = top.values.cpu().numpy()
                ids[chunk] = top.indices.cpu().numpy().astype(np.int32)
    values.flush()
    ids.flush()
    del values, ids
    dist.barrier()
    if rank == 0:
        (root / _DONE).write_text(json.dumps(expected))
    dist.barrier()


class TeacherCache:
    """Reads a complete cache: batch -> (top-k teacher logits, their token ids) on the batch's device."""

    def __init__(self, plan: RunPlan, run_dir: Path, data: TrainData) -> None:
        root = Path(run_dir) / TEACHER_CACHE_DIR
        self.values = np.load(root / _VALUES, mmap_mode="r")
        self.ids = np.load(root / _IDS, mmap_mode="r")
        self.rows: dict[bytes, int] = {}
        blocks = data.blocks_read(plan.config.train).tolist()
        for start in range(0, len(blocks), 256):
            chunk = blocks[start:start + 256]
            batch = data.train.batch(chunk)
            for i in range(len(chunk)):
                self.rows.setdefault(_digest(batch, i), start + i)

    def __call__(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        rows = [self.rows[_digest(batch, i)] for i in range(batch["input_ids"].shape[0])]
        device = batch["input_ids"].device
        values = torch.from_numpy(np.ascontiguousarray(self.values[rows])).to(device)
        ids = torch.from_numpy(np.ascontiguousarray(self.ids[rows])).to(device=device, dtype=torch.int64)
        return values, ids
