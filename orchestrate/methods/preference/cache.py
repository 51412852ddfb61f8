"""preference.placement precomputed: a first pass writes the reference's answer log-probabilities of
the two sequences (samples.py) of every record the run reads into RUN_DIR/reference_logps:
`<split>.npy`, float32 (documents of the split's stream, 2), row = the record's document
(`record_index`), NaN where no record is read. Training reads them instead of running the reference
(freed before the trained model is built, so the two never share memory).

The records read are known before step 1 (`records_read`): those of the training samples at the first
max_steps x global_batch_size positions of the sampler's seeded stream (TrainData.blocks_read: a
sample is a record, packed or not), every record from an epoch on, and every validation record.
A run shorter than an epoch pays for its own records only, as distillation's precomputed teacher.

The files are made from what `identity` names: the streams' cache keys, the settings that decide the
records and their cut (seq_len, truncation, the held-out split), the records read, the reference's
weight files by name, size and modification time, and the precision it ran in. A complete.json
written last holds it: a resumed run whose identity matches reuses the files; another one (an
interrupted pass, new data, a longer run, another or a retrained reference) is redone. Each rank
computes a strided share of the records into the shared files, all ranks running the same number of
forwards (a sharded reference gathers its blocks with every rank).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from orchestrate.methods.preference.losses import AnswerLogps
from orchestrate.methods.preference.objective import ReferenceLogps, answer_logps
from orchestrate.methods.preference.samples import PaddedPreferences, PreferenceSamples
from orchestrate.run.layout import REFERENCE_LOGPS_DIR

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig

_DONE = "complete.json"


def records_read(views: dict[str, PreferenceSamples], train_read: np.ndarray) -> dict[str, np.ndarray]:
    """Per split, the kept records (positions in its view) the run reads (module docstring):
    `train_read` the training samples it reads (TrainData.blocks_read)."""
    read = {"train": views["train"].records_at(train_read)}
    return {**read, **{split: np.arange(view.samples) for split, view in views.items() if split != "train"}}


def identity(config: RunConfig, views: dict[str, PreferenceSamples], records: dict[str, np.ndarray],
             reference_dir: Path, precision: str, run_dir: Path) -> dict:
    weights = sorted(Path(reference_dir).glob("*.safetensors"))
    inside = Path(reference_dir).resolve().is_relative_to(Path(run_dir).resolve())
    # the model's initial weights under the run directory: named relative to it (a copied run is the same)
    named = str(Path(reference_dir).resolve().relative_to(Path(run_dir).resolve())) if inside else str(reference_dir)
    d = config.data
    return {"streams": {split: str(view.stream_key) for split, view in views.items()},
            "records": {split: view.samples for split, view in views.items()},
            "read": {split: hashlib.blake2b(np.ascontiguousarray(records[split], dtype=np.int64).tobytes(),
                                            digest_size=16).hexdigest() for split in views},
            "seq_len": config.train.seq_len, "truncation": d.truncation, "validation_ratio": d.validation_ratio,
            "seed": config.train.seed, "loss": config.preference.loss, "reference": named,
            "weights": [[w.name, w.stat().st_size, w.stat().st_mtime_ns] for w in weights], "precision": precision,
            "version": 1}


def is_complete(run_dir: Path, expected: dict) -> bool:
    done = Path(run_dir) / REFERENCE_LOGPS_DIR / _DONE
    return done.is_file() and json.loads(done.read_text()) == expected


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def write_reference_logps(run_dir: Path, expected: dict, views: dict[str, PreferenceSamples],
                          records: dict[str, np.ndarray], reference: torch.nn.Module, device: torch.device,
                          rank: int, world_size: int, micro_batch: int) -> None:
    """The first pass (collective) over `records` (records_read). Returns at once where a complete pass
    of `expected` is there."""
    from numpy.lib.format import open_memmap

    if is_complete(run_dir, expected):
        return
    root = Path(run_dir) / REFERENCE_LOGPS_DIR
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        (root / _DONE).unlink(missing_ok=True)
        for split, view in views.items():
            out = open_memmap(root / f"{split}.npy", mode="w+", dtype=np.float32, shape=(view.documents, 2))
            out[:] = np.nan
            out.flush()
    _barrier()
    with torch.no_grad():
        for split, view in views.items():
            padded = PaddedPreferences.like(view)  # per sequence, whatever the training batches pack
            out = open_memmap(root / f"{split}.npy", mode="r+")
            mine = records[split][rank::world_size].tolist()
            rounds = -(-len(records[split]) // world_size)
            for start in range(0, rounds, micro_batch):
                chunk = mine[start: start + micro_batch]
                batch = padded.batch(chunk or [0])  # a rank out of records only joins the others' gathers
                logps = answer_logps(reference, {k: v.to(device) for k, v in batch.items()}).logps.float().cpu()
                if chunk:
                    out[batch["record_index"].numpy()] = logps.view(2, -1).T.numpy()
            out.flush()
            del out
    _barrier()
    if rank == 0:
        (root / _DONE).write_text(json.dumps(expected))
    _barrier()


def precomputed_reference(run_dir: Path, split: str) -> ReferenceLogps:
    """The first pass's log-probabilities of `split`'s records, in a batch's order (its `record_index`)."""
    table = np.load(Path(run_dir) / REFERENCE_LOGPS_DIR / f"{split}.npy", mmap_mode="r")

    def logps(model: torch.nn.Module, batch: dict) -> AnswerLogps:
        records = batch["record_index"]
        rows = torch.from_numpy(np.ascontiguousarray(table[records.cpu().numpy()]))  # (records, 2)
        if torch.isnan(rows).any():  # a batch the first pass did not foresee: an error, not a NaN loss
            missing = records[torch.isnan(rows).any(dim=1)].tolist()
            raise RuntimeError(f"the precomputed reference has no log-probabilities of {split} records {missing}: "
                               "the first pass covered the records the run was planned to read")
        labels = batch["labels"]
        tokens = AnswerLogps.scored_tokens(labels, batch["sequence"], 2 * records.numel())
        return AnswerLogps(rows.T.reshape(-1).to(labels.device), tokens)

    return logps
