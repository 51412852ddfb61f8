"""Run a function on N real gloo ranks on CPU, the way torchtune tests do: through torchrun's own
`elastic_launch`, so rendezvous, env vars and process groups are the production ones."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from orchestrate.ports import free_port


def run_on_ranks(fn: Callable[..., Any], nprocs: int, *args: Any) -> dict[int, Any]:
    """Call `fn(*args)` on `nprocs` processes; returns {rank: return value}. `fn` must be a
    module-level function (spawned processes import it) and call init_process_group itself
    (or use `init_gloo()` below)."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
    )
    return elastic_launch(config, fn)(*args)


def init_gloo() -> tuple[int, int]:
    """Initialise the default gloo process group from torchrun's env vars; returns (rank, world)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()
