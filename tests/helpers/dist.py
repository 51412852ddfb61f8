"""Run a function on N real gloo ranks on CPU, the way torchtune tests do: through torchrun's own
`elastic_launch`, so rendezvous, env vars and process groups are the production ones."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from orchestrate.ports import free_port


def run_on_ranks(fn: Callable[..., Any], nprocs: int, *args: Any) -> dict[int, Any]:
    """Call `fn(*args)` on `nprocs` processes; returns {rank: return value}. `fn` must be a
    module-level function (spawned processes import it) and call init_process_group itself
    (or use `init_gloo()` below).

    Each process gets its share of the cores as OpenMP threads, as `orchestrate launch` gives CPU workers
    (launch/rundir.py `worker_env`): with torch's default, one thread per core in every rank, the ranks'
    spinning OpenMP threads contend for the cores and a tiny matmul can take milliseconds (a 2-rank
    ZeRO-3 LoRA test: 32 s, 20 s with one thread per rank on 2 cores)."""
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
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = threads or str(max(1, (os.cpu_count() or 1) // nprocs))
    try:  # the spawned ranks inherit this environment
        return elastic_launch(config, fn)(*args)
    finally:
        if threads is None:
            del os.environ["OMP_NUM_THREADS"]


def init_gloo() -> tuple[int, int]:
    """Initialise the default gloo process group from torchrun's env vars; returns (rank, world)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()
