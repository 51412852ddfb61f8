"""Who am I: this process's rank, local rank, world size, node and device (`Rank`), the one record of
"which rank am I" on the worker side, beside the run directory (`orchestrate.run.layout.RunDir`). It
sits with the backends, which place the model by it; the worker makes it (orchestrate/worker/rank_start.py
reads torchrun's or SLURM's variables and starts the process group)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from orchestrate.backends.sequence_parallel import SequenceParallel


@dataclass(frozen=True)
class Rank:
    rank: int
    local_rank: int
    world_size: int
    node: int
    """This process's node: rank // ranks per node (torchrun numbers the ranks node by node)."""
    device: torch.device
    """cuda:<local_rank> on GPU machines, cpu otherwise."""
    sequence: SequenceParallel | None = None
    """Its sequence-parallel group (orchestrate/backends/sequence_parallel.py), None without one."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Its place among the ranks that read different samples (a sequence-parallel group reads the same)."""
        return self.rank // self.sequence.size if self.sequence else self.rank

    @property
    def data_world_size(self) -> int:
        return self.world_size // self.sequence.size if self.sequence else self.world_size
