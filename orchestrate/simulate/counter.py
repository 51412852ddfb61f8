"""Count the bytes of live tensor storages, op by op, on real or fake tensors.

A `TorchDispatchMode` sees every tensor an op returns; each distinct `UntypedStorage` is tracked by
identity with a weakref whose callback fires when the storage is really freed (storages keep their
Python object alive as long as any tensor holds them). `UntypedStorage.resize_` is not an op, so it
is patched while the counter is active: FSDP2 frees and re-gathers unsharded parameters by resizing
their storages to 0 and back (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, `free_storage`).
Same idea as torch's `MemTracker` (torch/distributed/_tools/mem_tracker.py), minus its per-module
bookkeeping, so a GPT-2 step costs seconds, not minutes.

Every storage lifetime is kept as a `Life` (birth and death on one event clock), so the breakdown at
the peak is computed afterwards: a storage learnt to be a gradient or an optimizer state *after*
it was born is still attributed right at a peak that came earlier.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# CUDA's caching allocator hands out multiples of 512 bytes (c10/cuda/CUDACachingAllocator.cpp,
# kMinBlockSize / round_size); reported alongside the exact byte count.
CUDA_BLOCK = 512


def cuda_rounded(nbytes: int) -> int:
    return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK


@dataclass
class Life:
    """One storage at one size, from birth to death (a resize ends one Life and starts another)."""

    nbytes: int
    birth: int
    phase: str
    """What was running when it was born: setup, forward, logits, backward, optimizer."""
    death: int | None = None
    tag: str | None = None
    """What it turned out to be (parameters, gradients, optimizer_states, ...), learnt later."""
    op: str = ""
    """The op whose output it was first seen as ("resize_" for FSDP2 re-gathers), for debugging."""
    stream: int = 0
    """The stream current at its birth, numbered as first seen (0: the default stream). On CPU,
    `torch.cpu.stream(...)` keeps the stream FSDP2 selects, as on CUDA (replay.py)."""

    def live_at(self, t: int) -> bool:
        return self.birth <= t and (self.death is None or t < self.death)


class LiveStorageCounter(TorchDispatchMode):
    """Tracks live storage bytes; `peak`, `peak_t` and `lives` say what was held when."""

    def __init__(self) -> None:
        super().__init__()
        self.t = 0
        self.current = 0
        self.current_cuda = 0
        self.peak = 0
        self.peak_t = 0
        self.peak_cuda = 0
        self.phase = "setup"
        self.lives: list[Life] = []
        self.marks: dict[str, list[tuple[int, int]]] = {}
        self._live: dict[int, tuple[Life, weakref.ref]] = {}
        # Storages may die on another thread (gloo work objects release tensors there).
        self._lock = threading.RLock()
        self._fake_mode = None
        self._orig_resize = None
        self._orig_propagate = None
        self._suspended = 0
        self._all_results: dict[int, weakref.ref] = {}
        self._streams: dict[Any, int] = {torch.cpu.current_stream(): 0}

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> LiveStorageCounter:
        # DTensor's sharding propagation runs ops under its own FakeTensorMode; only ops under the
        # mode that was active on entry (None for real runs) hold memory.
        self._fake_mode = active_fake_mode()
        self._orig_resize = orig = torch.UntypedStorage.resize_
        counter = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig(st, size)
            counter._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        # DTensor derives output shapes by running each op on global-shape fake tensors, under the
        # active FakeTensorMode if there is one (torch/distributed/tensor/_sharding_prop.py,
        # `_propagate_tensor_meta_non_cached`): full-size tensors nobody holds. Not counted.
        self._orig_propagate = propagate = ShardingPropagator._propagate_tensor_meta_non_cached

        def propagate_uncounted(prop: ShardingPropagator, op_schema: Any) -> Any:
            counter._suspended += 1
            try:
                return propagate(prop, op_schema)
            finally:
                counter._suspended -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate_uncounted
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize
        ShardingPropagator._propagate_tensor_meta_non_cached = self._orig_propagate
        super().__exit__(*exc)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak, self.peak_t, self.peak_cuda = self.current, self.t, self.current_cuda

    def mark(self, name: str) -> None:
        """Remember (event time, live bytes) under `name`, e.g. the end of each forward."""
        with self._lock:
            self.marks.setdefault(name, []).append((self.t, self.current))

    # -- tracking ----------------------------------------------------------------------------
    def track(self, tensors: Iterable[Any], op: str = "") -> None:
        for t in tensors:
            if isinstance(t, DTensor):
                t = t._local_tensor
            # Meta tensors hold no memory (DeepSpeed keeps meta copies of every parameter); a fake
            # tensor reports the device it stands for.
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track_storage(t.untyped_storage(), op)

    def _track_storage(self, st: torch.UntypedStorage, op: str = "") -> Life:
        key = id(st)
        with self._lock:
            entry = self._live.get(key)
            if entry is not None and entry[1]() is st:
                return entry[0]
            return self._birth(st, key, op=op)

    def _birth(self, st: torch.UntypedStorage, key: int, tag: str | None = None, op: str = "") -> Life:
        self.t += 1
        stream = self._streams.setdefault(torch.cpu.current_stream(), len(self._streams))
        life = Life(st.nbytes(), self.t, self.phase, tag=tag, op=op, stream=stream)
        ref = weakref.ref(st, lambda _ref, k=key, lf=life: self._died(k, lf))
        self._live[key] = (life, ref)
        self.lives.append(life)
        self._add(life.nbytes)
        return life

    def _died(self, key: int, life: Life) -> None:
        with self._lock:
            if life.death is not None:
                return
            self.t += 1
            life.death = self.t
            entry = self._live.get(key)
            if entry is not None and entry[0] is life:
                del self._live[key]
            self._add(-life.nbytes)

    def _resized(self, st: torch.UntypedStorage) -> None:
        # Tracked storages only: the ones a resize concerns were all created by ops we saw.
        key = id(st)
        with self._lock:
            entry = self._live.get(key)
            if entry is None or entry[1]() is not st:
                return
            old = entry[0]
            if old.nbytes == st.nbytes():
                return
            self.t += 1
            old.death = self.t
            self._add(-old.nbytes)
            del self._live[key]
            # Only FSDP2's unsharded parameters are resized in training: all-gather targets.
            self._birth(st, key, tag="gathered_params", op="resize_")
            old.tag = "gathered_params"

    def _add(self, delta: int) -> None:
        self.current += delta
        self.current_cuda += (1 if delta > 0 else -1) * cuda_rounded(abs(delta))
        if self.current > self.peak:
            self.peak, self.peak_t = self.current, self.t
        self.peak_cuda = max(self.peak_cuda, self.current_cuda)

    def tag(self, tag: str, tensors: Iterable[Any]) -> None:
        """Attribute the storages behind `tensors` (DTensors: their local shards) to `tag`."""
        with self._lock:
            for t in tensors:
                if isinstance(t, DTensor):
                    t = t._local_tensor
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self._track_storage(t.untyped_storage()).tag = tag

    # -- the dispatch hook -----------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Let DTensor lower itself to local ops first; those come back here and hold the memory.
        if any(t is DTensor for t in types):
            return NotImplemented
        if self._suspended:
            return func(*args, **kwargs)
        fake = self._fake_mode is not None and active_fake_mode() is self._fake_mode
        if fake and func is torch.ops.aten._local_scalar_dense.default:
            return self._fake_item(func, args[0])
        if fake and func is torch.ops._c10d_functional.wait_tensor.default:
            # Eager wait_tensor returns its input; the fake kernel would allocate a copy.
            return args[0]
        out = func(*args, **kwargs)
        if active_fake_mode() is self._fake_mode:
            self.track(tree_flatten(out)[0], func.__name__)
            if fake and func.overloadpacket is torch.ops.aten.all:
                st = out.untyped_storage()
                self._all_results[id(st)] = weakref.ref(st)
        return out

    def _fake_item(self, func: Any, t: torch.Tensor) -> Any:
        """`.item()` of a fake tensor: its value when it came from a Python constant, else the answer
        healthy real data gives: `.all()` checks hold (no padding, no packed sequences), any other
        flag is off (no inf/nan overflow), a float is a finite norm."""
        try:
            return func(t)
        except DataDependentOutputException:
            pass
        if t.dtype == torch.bool:
            st = t.untyped_storage()
            ref = self._all_results.get(id(st))
            return ref is not None and ref() is st
        return 1.0 if t.is_floating_point() else 0
