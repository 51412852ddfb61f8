"""Whole samples into blocks of `seq_len` tokens: best-fit decreasing.

Samples are taken longest first and each goes into the open block with the least room that still
holds it (a new block when none does), so no sample is ever cut across blocks. BFD packs as tightly
as first-fit decreasing (both within 11/9 of the optimum plus a constant; Johnson et al. 1974,
"Worst-case performance bounds for simple one-dimensional packing algorithms") and is what TRL's
`packing_strategy="bfd"` uses. Open blocks are kept by remaining room in a sorted list, so each
sample costs a bisection: a million samples pack in seconds.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Blocks:
    """Block b holds samples members[starts[b]:starts[b+1]] (indices into the packed lengths), in order."""

    starts: np.ndarray
    members: np.ndarray
    tokens: int
    """Tokens of all samples together."""
    capacity: int

    def __len__(self) -> int:
        return len(self.starts) - 1

    def of(self, block: int) -> np.ndarray:
        return self.members[self.starts[block]: self.starts[block + 1]]

    @property
    def efficiency(self) -> float:
        """Share of the blocks' positions that hold sample tokens (the rest is padding)."""
        return self.tokens / (len(self) * self.capacity) if len(self) else 0.0


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> Blocks:
    """Pack samples of `lengths` (each 1..capacity) into blocks of `capacity` tokens."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"sample lengths must be 1..{capacity}")  # internal: callers truncate first
    bins: list[list[int]] = []
    open_by_room: dict[int, list[int]] = {}
    rooms: list[int] = []  # sorted distinct remaining rooms of open blocks
    for i in np.argsort(-lengths, kind="stable").tolist():
        size = int(lengths[i])
        j = bisect.bisect_left(rooms, size)
        if j < len(rooms):
            room = rooms[j]
            block = open_by_room[room].pop()
            if not open_by_room[room]:
                del open_by_room[room]
                rooms.pop(j)
        else:
            room, block = capacity, len(bins)
            bins.append([])
        bins[block].append(i)
        left = room - size
        if left:
            if left not in open_by_room:
                bisect.insort(rooms, left)
                open_by_room[left] = []
            open_by_room[left].append(block)
    starts = np.zeros(len(bins) + 1, dtype=np.int64)
    starts[1:] = np.cumsum([len(b) for b in bins])
    members = np.fromiter((i for b in bins for i in b), dtype=np.int64, count=int(starts[-1]))
    return Blocks(starts, members, int(lengths.sum()), capacity)
