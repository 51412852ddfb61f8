"""A resumable distributed sampler over packed blocks.

Each epoch draws one seeded permutation of all blocks, identical on every rank; rank r takes
positions r, r + W, r + 2W, ... of it, truncated so every rank gets the same count (the few left-over
blocks of an epoch are skipped, as torch's DistributedSampler with drop_last does). The state
(epoch, position, seed) fully determines what comes next, so a resumed run continues the exact order.
"""

from __future__ import annotations

import torch


class DistributedBlockSampler:
    def __init__(self, num_blocks: int, rank: int, world_size: int, seed: int):
        if num_blocks < world_size:
            raise ValueError(f"{num_blocks} blocks cannot be shared by {world_size} ranks")
        self.num_blocks = num_blocks
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        """Index into this rank's share of the current epoch of the next block to hand out."""
        self._share = self._epoch_share(0)

    @property
    def per_rank(self) -> int:
        return self.num_blocks // self.world_size

    def _epoch_share(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(self.num_blocks, generator=g)
        return perm[self.rank : self.per_rank * self.world_size : self.world_size]

    def take(self, count: int) -> list[int]:
        """The next `count` block indices of this rank, rolling into the next epoch when needed."""
        out: list[int] = []
        while len(out) < count:
            if self.position >= self.per_rank:
                self.epoch += 1
                self.position = 0
                self._share = self._epoch_share(self.epoch)
            k = min(count - len(out), self.per_rank - self.position)
            out += self._share[self.position : self.position + k].tolist()
            self.position += k
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._share = self._epoch_share(self.epoch)
