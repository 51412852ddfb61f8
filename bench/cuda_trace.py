"""What a CUDA process allocated and freed, in order, as torch's caching allocator recorded it; and the
replay of that record through orchestrate's allocator model (orchestrate/simulate/allocator.py).

On a GPU, `start()` turns on torch's allocation history (`torch.cuda.memory._record_memory_history`,
no stack traces: a few bytes an event) and `dump(path, ...)` writes the history compactly (gzip JSON:
action, address, size, stream per event) with the allocator's own peaks (`memory_stats`), its settings
(PYTORCH_CUDA_ALLOC_CONF), the memory cap and the device memory outside the allocator (CUDA context,
libraries' own buffers: device used minus reserved, from cudaMemGetInfo / NVML). bench/gpu_worker.py
records every GPU-check run this way; bench/cuda_constants.py its own small runs.

On any machine, `replay_trace(record)` feeds the allocations and completed frees to the model with the
recorded settings and cap, and returns the model's allocated and reserved peaks beside the real ones
(bench/allocator_trace_check.py prints them): a check of the allocator model against the allocator.

Event names are torch's (`torch.cuda.memory._snapshot()["device_traces"]`): `alloc` (size = the
requested bytes), `free_requested` (the tensor died), `free_completed` (the block is back in the pool;
later than the request only when `record_stream` made it wait for another stream), `segment_alloc` /
`segment_free` (cudaMalloc / cudaFree), `segment_map` / `segment_unmap` (expandable segments' pages).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "oom", "snapshot")
STEP_MARK_BYTES = 4099
"""An odd request no library makes: bench/gpu_worker.py allocates and frees one at the start and the end
of each training step, so a history splits into set-up, steps and what follows (final eval and save)."""
MAX_ENTRIES = 20_000_000
"""History kept (a ring buffer past this: `truncated` then says the replay cannot start from empty)."""


def start() -> None:
    import torch

    torch.cuda.init()  # the per-device allocators the history is switched on in exist from here
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=MAX_ENTRIES)


def device_used_bytes(device: int = 0) -> int | None:
    """Device memory in use by every process (NVML; no CUDA context needed), None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(device)).used)
    except Exception:  # noqa: BLE001 - no NVML, no driver: the figure is simply not there
        return None


def dump(path: Path, device: int, used_before_cuda: int | None, cap_bytes: int | None, meta: dict) -> dict:
    """Write this process's allocation history and peaks to `path` (gzip JSON); return the summary."""
    import torch

    torch.cuda.synchronize(device)
    stats = torch.cuda.memory_stats(device)
    used_now = device_used_bytes(device)
    snap = torch.cuda.memory._snapshot()
    traces = snap["device_traces"][device]
    events = [[ACTIONS.index(e["action"]), e["addr"], e["size"], e["stream"]] for e in traces
              if e["action"] in ACTIONS]
    reserved_now = torch.cuda.memory_reserved(device)
    summary = {
        **meta,
        "torch": torch.__version__, "cuda": torch.version.cuda, "device_name": torch.cuda.get_device_name(device),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "cap_bytes": cap_bytes,
        "max_allocated": stats.get("allocated_bytes.all.peak", 0), "max_reserved": stats.get("reserved_bytes.all.peak", 0),
        "alloc_retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0),
        "reserved_now": reserved_now, "used_before_cuda": used_before_cuda, "used_now": used_now,
        # Memory this process holds outside the caching allocator: CUDA context, loaded kernels, cuBLAS
        # and NCCL's own buffers (device-wide figures, so only meaningful with one process on the GPU).
        "outside_allocator": (used_now - used_before_cuda - reserved_now)
        if used_now is not None and used_before_cuda is not None else None,
        "events_recorded": len(traces), "truncated": len(traces) >= MAX_ENTRIES,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"summary": summary, "actions": list(ACTIONS), "events": events}, f, separators=(",", ":"))
    return summary


def read(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def real_reserved_peak(record: dict) -> int:
    """Peak of the segments the allocator held, summed from its own segment events."""
    actions = record["actions"]
    grow = {actions.index("segment_alloc"), actions.index("segment_map")}
    shrink = {actions.index("segment_free"), actions.index("segment_unmap")}
    reserved = peak = 0
    for action, _addr, size, _stream in record["events"]:
        if action in grow:
            reserved += size
            peak = max(peak, reserved)
        elif action in shrink:
            reserved -= size
    return peak


def unmarked_steps_peaks(record: dict) -> dict | None:
    """For a history without step markers: the model's allocated and reserved peaks from the last cache
    release that precedes the last 5 % of the events (the worker empties the cache before step 1) up to
    that last 5 % (the final eval and save). An approximation, None without such a release."""
    from orchestrate.simulate.allocator import CachingAllocator
    from orchestrate.simulate.allocator_settings import AllocatorSettings

    summary, actions, events = record["summary"], record["actions"], record["events"]
    a_alloc, a_free = actions.index("alloc"), actions.index("free_completed")
    give_back = {actions.index("segment_free"), actions.index("segment_unmap")}
    end = int(len(events) * 0.95)
    starts = [i for i in range(1, end) if events[i][0] in give_back and events[i - 1][0] not in give_back]
    if not starts:
        return None
    alloc = CachingAllocator(AllocatorSettings.parse(summary["alloc_conf"]), summary.get("cap_bytes"))
    live: dict[int, object] = {}
    peaks = [0, 0]
    for i, (action, addr, size, stream) in enumerate(events[:end]):
        if action in give_back and events[i - 1][0] not in give_back:
            alloc.empty_cache()
        if action == a_alloc:
            live[addr] = alloc.malloc(size, stream)
        elif action == a_free and addr in live:
            alloc.free(live.pop(addr))
        if i >= starts[-1]:
            peaks = [max(peaks[0], alloc.allocated), max(peaks[1], alloc.reserved)]
    return {"allocated": peaks[0], "reserved": peaks[1]}


def needed_bytes(record: dict, granularity: int = 2 * 2**20) -> int:
    """The least device memory the recorded history runs in under the allocator model (bisected in
    2 MiB steps between its allocated and its reserved peak): what the planner's allocator part
    predicts, where a reserved peak on a card with room also counts cache that was never given back."""
    summary = record["summary"]
    lo, hi = -(-summary["max_allocated"] // granularity) - 1, -(-summary["max_reserved"] // granularity)  # lo fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        capped = {**record, "summary": {**summary, "cap_bytes": mid * granularity}}
        if replay_trace(capped)["model_oom"]:
            lo = mid
        else:
            hi = mid
    return hi * granularity


def replay_trace(record: dict, settings_text: str | None = None) -> dict:
    """The model's peaks over the recorded allocations and completed frees (settings from the record
    unless given), and the real ones. Where the allocator gave segments back (`torch.cuda.empty_cache()`,
    or a retry after a failed cudaMalloc, which releases the cache too), the model empties its cache at
    the same point. A free of an address the record never saw allocated (a history that started late)
    is skipped and counted."""
    from orchestrate.simulate.allocator import CachingAllocator, OutOfMemory
    from orchestrate.simulate.allocator_settings import AllocatorSettings

    summary = record["summary"]
    settings = AllocatorSettings.parse(summary["alloc_conf"] if settings_text is None else settings_text)
    alloc = CachingAllocator(settings, summary.get("cap_bytes"))
    actions = record["actions"]
    a_alloc, a_free = actions.index("alloc"), actions.index("free_completed")
    give_back = {actions.index("segment_free"), actions.index("segment_unmap")}
    live: dict[int, object] = {}
    unknown_frees = releases = marks = 0
    oom = None
    previous = None
    phases = {"setup": [0, 0], "steps": [0, 0], "after": [0, 0]}  # allocated and reserved peaks
    phase = phases["setup"]
    for action, addr, size, stream in record["events"]:
        if action in give_back and previous not in give_back:
            alloc.empty_cache()
            releases += 1
        previous = action
        if action == a_alloc and size == STEP_MARK_BYTES:  # a step's start (even count) or end (odd)
            phase = phases["steps"] if marks % 2 == 0 else phases["after"]
            marks += 1
        if action == a_alloc:
            try:
                live[addr] = alloc.malloc(size, stream)
            except OutOfMemory as exc:
                oom = str(exc)
                break
        elif action == a_free:
            block = live.pop(addr, None)
            if block is None:
                unknown_frees += 1
            else:
                alloc.free(block)
        phase[0], phase[1] = max(phase[0], alloc.allocated), max(phase[1], alloc.reserved)
    return {"model_allocated": alloc.peak_allocated, "model_reserved": alloc.peak_reserved,
            "model_retries": alloc.retries, "model_oom": oom,
            "real_allocated": summary["max_allocated"], "real_reserved": summary["max_reserved"],
            "real_reserved_from_events": real_reserved_peak(record), "real_retries": summary["alloc_retries"],
            "unknown_frees": unknown_frees, "cache_releases": releases, "steps_marked": marks // 2,
            "phase_peaks": {name: {"allocated": a, "reserved": r} for name, (a, r) in phases.items()} if marks else None, "settings": settings_text if settings_text is not None else summary["alloc_conf"]}
