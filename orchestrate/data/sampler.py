"""A resumable distributed sampler whose order is defined globally, independent of the world size.

The global order is the endless stream perm(0) ++ perm(1) ++ ..., where perm(e) is a permutation of
all N blocks seeded by (seed, e): epoch e is positions [e*N, (e+1)*N) of the stream. Every rank
calls `take(count)` in lockstep (the same count on all ranks); one such call consumes the next
world_size * count positions, and rank r gets the r-th run of `count` of them. A global batch of
B = micro x accumulation x world samples therefore consumes positions [g*B, (g+1)*B) whatever the
world size: resuming on a different number of ranks (with the same global batch size) sees the same
samples in every step, only dealt out differently. Nothing is dropped at epoch ends: a call may
straddle two epochs.

State: (epoch, position within the epoch, seed) plus the block count and the data's identity
(orchestrate/data/identity.py), so a checkpoint taken on any world size restores the exact place in
the stream, and a resume on changed data is refused, edited contents with the same block count too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from orchestrate.data.identity import check_same_data
from orchestrate.errors import Problem, UserError


class DistributedBlockSampler:
    def __init__(self, num_blocks: int, rank: int, world_size: int, seed: int, data: dict[str, Any] | None = None):
        if num_blocks < world_size:
            raise ValueError(f"{num_blocks} blocks cannot be shared by {world_size} ranks")
        self.num_blocks = num_blocks
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.data = data
        """`data_identity` of the samples (None: data of your own module, not fingerprinted)."""
        self.epoch = 0
        self.position = 0
        """Stream positions of the current epoch consumed so far, by all ranks together."""
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            # One (seed, epoch) stream per epoch: reproducible, and every rank computes the same one.
            rng = np.random.default_rng([self.seed % 2**64, epoch])
            dtype = np.int32 if self.num_blocks < 2**31 else np.int64  # 4 bytes per block in RAM
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}  # keep at most two
            self._perms[epoch] = rng.permutation(self.num_blocks).astype(dtype)
        return self._perms[epoch]

    def _at(self, positions: np.ndarray) -> np.ndarray:
        """Block ids at global stream positions (counted from the start of epoch 0)."""
        epochs, offsets = np.divmod(positions, self.num_blocks)
        out = np.empty(len(positions), dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[offsets[sel]]
        return out

    def take(self, count: int) -> list[int]:
        """This rank's next `count` block indices. Every rank must call it with the same count."""
        start = self.epoch * self.num_blocks + self.position + self.rank * count
        ids = self._at(np.arange(start, start + count, dtype=np.int64))
        self.epoch, self.position = divmod(self.epoch * self.num_blocks + self.position + self.world_size * count,
                                           self.num_blocks)
        return ids.tolist()

    def blocks_read(self, samples: int) -> np.ndarray:
        """The distinct blocks of the stream's first `samples` positions, sorted: what a run that
        reads that many samples trains on (every block from one epoch on)."""
        if samples >= self.num_blocks:
            return np.arange(self.num_blocks)
        return np.sort(self._perm(0)[:samples])

    def state_dict(self) -> dict[str, Any]:
        """JSON-able and world-size independent."""
        state = {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_blocks": self.num_blocks}
        return state if self.data is None else {**state, "data": self.data}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.data is not None and state.get("data") is not None:
            check_same_data(state["data"], self.data, "the checkpoint")
        saved = int(state.get("num_blocks", self.num_blocks))
        if saved != self.num_blocks:
            raise UserError("the training data changed since the checkpoint", [Problem(
                "data", f"the checkpoint's sampler covered {saved} blocks, the data now gives {self.num_blocks}",
                "resume with the same data, tokenizer, seq_len and validation settings, or start a new run")])
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._perms = {}
