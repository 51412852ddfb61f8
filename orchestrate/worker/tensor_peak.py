"""The live-tensor peak of a CPU rank: what the memory verdict compares with the plan's per-rank
prediction on a CPU run. torch keeps no CPU allocator statistics (torch.cuda.max_memory_allocated has
no CPU twin in torch 2.13), and a process RSS also holds the interpreter and every library: several
hundred MiB before the first tensor.

A `TorchDispatchMode` sees every tensor an op returns; each distinct storage is counted once, until
the weakref on it fires when the storage is freed (as the simulation's counter does,
orchestrate/simulate/counter.py, without its per-storage history). FSDP2 frees and re-gathers
parameters by resizing their storages (`UntypedStorage.resize_`, not an op), so that is followed
too. Tensors made before `start` and never passed through an op are not seen (none of the plan's
terms: the data is memory-mapped, the model is built after `start`).

Counting costs a Python call per op (a sizeable share of a small step:
docs/measurements.md#workertensor_peakpy), so it covers start-up and the first COUNTED_STEPS steps,
then stops: step 1 creates the optimizer state, step 2 is the first to hold it during the forward and
backward pass, and every later step of a fixed-shape loop repeats step 2's allocations. The peak stays
what those steps reached.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

COUNTED_STEPS = 3
"""Steps counted after start-up (one past the first step that holds the optimizer state)."""


class TensorPeak(TorchDispatchMode):
    """Bytes of the CPU tensor storages alive at once, from `start` to `stop`; `peak` the most."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.steps = 0
        self._sizes: dict[int, tuple[int, weakref.ref]] = {}
        self._lock = threading.Lock()  # gloo's threads free tensors too
        self._resize: Any = None

    @classmethod
    def start(cls) -> TensorPeak:
        counter = cls()
        counter._resize = resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = resize(storage, size)
            counter._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        counter.__enter__()
        return counter

    def step_done(self) -> None:
        self.steps += 1
        if self.steps == COUNTED_STEPS:
            self.stop()

    def stop(self) -> None:
        """No more counting (the peak stays); a second call does nothing."""
        if self._resize is not None:
            self.__exit__(None, None, None)
            torch.UntypedStorage.resize_ = self._resize
            self._resize = None

    @property
    def counting(self) -> bool:
        return self._resize is not None

    def _add(self, delta: int) -> None:
        self.live += delta
        if self.live > self.peak:
            self.peak = self.live

    def _track(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or isinstance(t, FakeTensor) \
                or t.layout != torch.strided:
            return
        storage = t.untyped_storage()
        key = id(storage)
        with self._lock:
            seen = self._sizes.get(key)
            if seen is not None and seen[1]() is storage:
                return
            size = storage.nbytes()
            self._sizes[key] = (size, weakref.ref(storage, lambda _ref, k=key: self._freed(k)))
            self._add(size)

    def _freed(self, key: int) -> None:
        with self._lock:
            seen = self._sizes.pop(key, None)
            if seen is not None:
                self._add(-seen[0])

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        with self._lock:
            seen = self._sizes.get(key)
            if seen is not None and seen[1]() is storage:
                self._sizes[key] = (storage.nbytes(), seen[1])
                self._add(storage.nbytes() - seen[0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:  # DTensor lowers itself to local ops, which come back here
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if isinstance(out, (tuple, list)):
            for t in out:
                self._track(t)
        else:
            self._track(out)
        return out
