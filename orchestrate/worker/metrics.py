"""Per-step measurements, gathered over ranks, appended as one JSON object per line to metrics.jsonl.

Memory is measured next to what the plan predicted, so every run checks the planner:
- `gpu_max_allocated_bytes` / `gpu_max_reserved_bytes`: torch.cuda peaks, max over ranks (GPU only),
  against `predicted_gpu_bytes_per_rank`;
- `cpu_tensor_peak_bytes`: CPU runs only: the largest live-tensor peak of any rank
  (orchestrate/worker/tensor_peak.py), the counterpart of the per-rank prediction where the plan's
  "device" is the worker's own RAM;
- `rss_peak_bytes_max_rank`: the largest process RSS peak of any rank (interpreter, libraries and
  tensors: shown, not compared);
- `node_rss_peak_bytes`: the sum of the RSS peaks of node 0's ranks (an upper bound of the node's
  peak: the processes need not peak together), against `predicted_cpu_bytes_per_node`.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from orchestrate.run.layout import read_records

_STAT_FIELDS = ("loss", "rss", "tensors", "gpu_alloc", "gpu_reserved", "node", "loss_tokens", "stop_elapsed",
                "save_s")


def rss_peak_bytes() -> int:
    """This process's peak resident set size (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def gather_step_stats(loss: float, node: int, device: torch.device,
                      stop: tuple[float, float] = (-1.0, -1.0), loss_tokens: int = 0,
                      tensor_peak: int | None = None) -> dict[str, float]:
    """One all_gather per step of (loss, RSS peak, live-tensor peak, GPU peaks, node index, the tokens
    that carried loss, the stop request's `StopRequest.local` values) from every rank: the step's only
    collective besides training. `stop_max` holds the maxima of the stop values over ranks, for
    `StopRequest.decide`. `tensor_peak`: this rank's `TensorPeak.peak` (CPU runs)."""
    cuda = device.type == "cuda"
    local = torch.tensor([
        loss, float(rss_peak_bytes()), float(tensor_peak if tensor_peak is not None else -1),
        float(torch.cuda.max_memory_allocated(device)) if cuda else 0.0,
        float(torch.cuda.max_memory_reserved(device)) if cuda else 0.0,
        float(node), float(loss_tokens), *stop,
    ], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, local)
        table = torch.stack(rows).cpu()
    else:
        table = local.cpu().unsqueeze(0)
    stats = dict(zip(_STAT_FIELDS, table.T, strict=True))
    out = {
        "loss": float(stats["loss"].mean()),
        "rss_peak_bytes_max_rank": int(stats["rss"].max()),
        "node_rss_peak_bytes": int(stats["rss"][stats["node"] == 0].sum()),
        "loss_tokens": int(stats["loss_tokens"].sum()),
        "stop_max": (float(stats["stop_elapsed"].max()), float(stats["save_s"].max())),
    }
    if tensor_peak is not None:
        out["cpu_tensor_peak_bytes"] = int(stats["tensors"].max())
    if cuda:
        out["gpu_max_allocated_bytes"] = int(stats["gpu_alloc"].max())
        out["gpu_max_reserved_bytes"] = int(stats["gpu_reserved"].max())
    return out


def sum_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Each value summed over all ranks (every rank passes the same keys, in any order)."""
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return dict(zip(keys, t.tolist(), strict=True))


class MetricsWriter:
    """Writes records to RUN_DIR/metrics.jsonl, flushed per line so `tail -f` and the launcher see
    each step as it happens. A fresh run starts the file afresh. A run resumed from the checkpoint
    of step N keeps the records of steps 1..N and appends from N+1: the steps a crash made it
    recompute are replaced, never duplicated (a torn last line is dropped too)."""

    def __init__(self, path: Path, resume_step: int = 0):
        self.path = path
        if resume_step > 0 and path.exists():
            kept = [json.dumps(r) + "\n" for r in read_records(path) if r["step"] <= resume_step]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            tmp.replace(path)
            self._file = path.open("a", encoding="utf-8")
        else:
            self._file = path.open("w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
