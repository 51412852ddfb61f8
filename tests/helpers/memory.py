"""Memory measurement for tests and benchmarks (Linux /proc), and random model directories.

PSS (proportional set size) counts a page shared by k processes as 1/k in each, so the PSS of all
processes of a node adds up to what the node really holds: file pages that several workers map
(a memory-mapped token file, the page cache of a safetensors file) count once, not once per worker.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import psutil

KB = 1024


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """Bytes per field of /proc/PID/smaps_rollup (Rss, Pss, Pss_Anon, Pss_File, Private_*, ...)."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * KB
    return out


def peak_rss(pid: int | str = "self") -> int:
    """VmHWM: the process's peak resident set (file-backed pages included)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * KB
    raise RuntimeError("no VmHWM in /proc/PID/status")


class NodePeak:
    """Samples the summed PSS and RSS of this process's descendants (the ranks a launcher spawned)
    every `interval_s`, keeping the peaks: the node's memory as the OS sees it, over time."""

    def __init__(self, interval_s: float = 0.02, include_self: bool = False):
        self.interval_s = interval_s
        self.include_self = include_self
        self.pss = 0
        self.rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        me = psutil.Process()
        procs = me.children(recursive=True) + ([me] if self.include_self else [])
        pss = rss = 0
        for p in procs:
            try:
                m = smaps_rollup(p.pid)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
            pss += m.get("Pss", 0)
            rss += m.get("Rss", 0)
        self.pss, self.rss = max(self.pss, pss), max(self.rss, rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> NodePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def write_random_model(out_dir: Path, architecture: dict, shard_bytes: int = 512 * 2**20, seed: int = 0,
                       dtype: str = "float32") -> int:
    """A Hugging Face model directory of random weights in sharded safetensors (floating tensors in
    `dtype`; Hub checkpoints are mostly bfloat16), written one shard at a time (never the whole
    model in memory); returns the parameter count."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from orchestrate.backends.hf_io import StateLayout
    from orchestrate.model.meta import build_meta_model

    out_dir.mkdir(parents=True, exist_ok=True)
    arch = dict(architecture)
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    layout = StateLayout.of(build_meta_model(config))
    keys = [k for k in layout.tensors if k not in layout.aliases]
    store = getattr(torch, dtype)
    shards: list[list[str]] = [[]]  # assign tensors to shards from their shapes first: names need the count
    size = 0
    for key in keys:
        shape, kind = layout.tensors[key]
        nbytes = math.prod(shape) * (store.itemsize if kind.is_floating_point else kind.itemsize)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key in shard:
            shape, kind = layout.tensors[key]
            tensors[key] = (torch.randn(shape, generator=gen) * 0.02).to(store) if kind.is_floating_point \
                else torch.zeros(shape, dtype=kind)
            total += tensors[key].numel()
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(out_dir)
    return total


def mapping_bytes(pid: int, path: Path) -> dict[str, int]:
    """Rss, Pss, Shared_* and Private_* of the process's mappings of `path` (/proc/PID/smaps)."""
    out: dict[str, int] = {}
    inside = False
    target = str(Path(path).resolve())
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and "-" in fields[0] and ":" not in fields[0]:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5] == target
        elif inside and len(fields) == 3 and fields[2] == "kB":
            out[fields[0].rstrip(":")] = out.get(fields[0].rstrip(":"), 0) + int(fields[1]) * KB
    return out


# A data worker: map the entry, read every block through the training path, report, wait to be released.
_MAPPING_WORKER = """
import sys
from pathlib import Path
from orchestrate.data.blocks import PackedBlocks
from orchestrate.data.cache import open_entry
blocks = PackedBlocks(open_entry(Path(sys.argv[1])), seq_len=int(sys.argv[2]))
for start in range(0, len(blocks), 64):
    blocks.batch(list(range(start, min(start + 64, len(blocks)))))
print("ready", flush=True)
sys.stdin.readline()
"""


def measure_mapping_workers(entry: Path, workers: int, seq_len: int = 2048) -> list[dict[str, int]]:
    """Start `workers` processes that each read all of the cache entry's blocks; while all of them
    are alive, return per worker its tokens.bin mapping (Rss, Pss, ...) and process_pss."""
    import subprocess
    import sys

    from orchestrate.data.cache import TOKENS_FILE

    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", _MAPPING_WORKER, str(entry), str(seq_len)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root)
             for _ in range(workers)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a mapping worker failed")
        return [{**mapping_bytes(p.pid, entry / TOKENS_FILE), "process_pss": smaps_rollup(p.pid)["Pss"]}
                for p in procs]
    finally:
        for p in procs:
            p.communicate("\n", timeout=120)
