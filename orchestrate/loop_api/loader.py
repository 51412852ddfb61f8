"""The user's DataLoader rebuilt for this rank: the same dataset, collate function and workers, a
`DistributedSampler` (each rank its own share; shuffled when the user's loader shuffled, with
`train.seed`), and the plan's micro-batch size, which is what the memory plan is for (the step's
batch is micro-batch x gradient accumulation x ranks = train.global_batch_size).

`EpochLoader` sets the sampler's epoch on every new pass, so the seed's loop (`for data, target in
loader`) gets a new order each epoch without a `set_epoch` call, and the epoch count is what a
checkpoint saves to resume at the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    from torch.utils.data import DataLoader


def to_device(batch: Any, device: Any, float_dtype: Any = None) -> Any:
    """The batch's tensors on `device` (tuples, lists and dicts of them too), as the seed's `.cuda()`;
    floating-point ones cast to `float_dtype` when given."""
    if hasattr(batch, "to"):
        if float_dtype is not None and getattr(batch, "is_floating_point", lambda: False)():
            return batch.to(device, dtype=float_dtype, non_blocking=True)
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device, float_dtype) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device, float_dtype) for v in batch)
    return batch


class EpochLoader:
    """Iterates the wrapped loader, one sampler epoch per pass, batches on the rank's device."""

    def __init__(self, loader: DataLoader, device: Any, float_dtype: Any = None) -> None:
        self.loader = loader
        self.device = device
        self.float_dtype = float_dtype
        """DeepSpeed bf16/fp16 runs the module in that dtype (no autocast): float inputs must match."""
        self.sampler = loader.sampler
        self.epoch = 0
        """Passes started so far: the next pass uses sampler epoch `epoch`."""

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return (to_device(batch, self.device, self.float_dtype) for batch in self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])


def distributed_loader(loader: DataLoader, micro_batch_size: int, rank: int, world_size: int,
                       seed: int, device: Any, float_dtype: Any = None) -> EpochLoader:
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

    if isinstance(loader.dataset, IterableDataset):
        raise UserError("orchestrate.prepare cannot shard an IterableDataset", [Problem(
            "orchestrate.prepare(loader)", "a DistributedSampler needs a map-style dataset (__getitem__, __len__)",
            "give a map-style Dataset, or shard the stream yourself and leave the loader out of prepare")])
    sampler = DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank,
                                 shuffle=isinstance(loader.sampler, RandomSampler), seed=seed,
                                 drop_last=loader.drop_last)
    return EpochLoader(DataLoader(
        loader.dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=loader.collate_fn,
        num_workers=loader.num_workers, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
        worker_init_fn=loader.worker_init_fn, persistent_workers=loader.persistent_workers), device, float_dtype)
