"""The model of a DDP plan on one rank: trained as it is, without DistributedDataParallel.

DDP on one rank has nothing to reduce, yet its reducer allocates gradient buckets that are a second
copy of every gradient (torch DistributedDataParallel docs, `gradient_as_bucket_view`): 4 bytes per
trained parameter held through the whole run. `SingleRank` keeps the two things the DDP engine and an
own loop use of the wrapper, `.module` (so saved state keeps DDP's key layout) and `no_sync()`.
"""

from __future__ import annotations

import contextlib

import torch


class SingleRank(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def wrap(model: torch.nn.Module, device: torch.device, world_size: int) -> torch.nn.Module:
    """DistributedDataParallel over more than one rank (rank 0's weights broadcast at construction),
    `SingleRank` on one."""
    if world_size == 1:
        return SingleRank(model)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
