"""Build a frozen auxiliary model on a worker (a distillation teacher; a preference method's reference
model), placed as the plan's chosen candidate says (`Candidate.placements`, searched by the planner:
orchestrate/planner/auxiliary.py). The same builder serves every backend: it runs before the
backend's `setup`, so no `HfDeepSpeedConfig` of a ZeRO-3 model is alive yet (while one is,
transformers builds every model inside `deepspeed.zero.Init`: the auxiliary model would come out
partitioned, with nothing to gather it for its forward).

- replicated: the whole model on this rank's device, filled tensor by tensor (loading/weights.py).
- sharded / offload: FSDP2 `fully_shard(reshard_after_forward=True)` per block and the root over
  all ranks, from the meta device, each rank reading only its own rows (as the FSDP backend loads
  the trained model); offload adds `CPUOffloadPolicy` (shards in CPU RAM, which needs an
  accelerator: on a CPU-only worker the replicated model is in host memory already).
- precomputed: built lean (`lean_placement`) for the method's first pass, which writes its outputs
  into the run directory, then freed before the trained model is built.
Every parameter is frozen (`requires_grad=False`), the module in eval mode (no dropout).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from orchestrate.backends import hf_io
from orchestrate.loading.weights import cast_floating_parameters, load_replicated, load_sharded, meta_model
from orchestrate.planner.auxiliary import resolve_placement
from orchestrate.planner.plan import RunPlan

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def placement_on(plan: RunPlan, name: str, configured: str, device: torch.device, world_size: int) -> str:
    """The placement this worker builds auxiliary model `name` at: the plan's, with offload as replicated
    on a CPU device and sharding over one rank as replicated (nothing to split)."""
    placement = plan.chosen.placements.get(name) or resolve_placement(configured, plan.strategy, world_size)
    if (placement == "offload" and device.type == "cpu") or (placement == "sharded" and world_size == 1):
        return "replicated"
    return placement


def lean_placement(device: torch.device, world_size: int) -> str:
    """Where a precomputing first pass holds the model: as little of it per device as there is, its
    shards offloaded to the CPU (GPUs), or sharded over the ranks (planner/auxiliary.py first_pass_bytes)."""
    return "offload" if device.type == "cuda" else "sharded" if world_size > 1 else "replicated"


def build_frozen(plan: RunPlan, path: Path, device: torch.device, world_size: int, placement: str) -> torch.nn.Module:
    """The model of directory `path` at `placement`, in the plan's compute dtype, frozen, in eval mode."""
    dtype = getattr(torch, _DTYPES[plan.strategy.precision])
    trust, task = plan.config.model.trust_remote_code, plan.config.model.task
    if placement == "replicated":
        model = load_replicated(path, device, dtype, trust, task)
    else:
        model = _sharded(path, device, world_size, dtype, trust, task, offload=placement == "offload")
    model.requires_grad_(False)
    return model.eval()


def _sharded(path: Path, device: torch.device, world_size: int, dtype: torch.dtype, trust: bool, task: str,
             offload: bool) -> torch.nn.Module:
    model, hf_config, layout = meta_model(path, trust, task)
    cast_floating_parameters(model, dtype)  # on meta: free; the shards are then allocated in the compute dtype
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    kwargs = {"mesh": mesh, "reshard_after_forward": True,
              "offload_policy": CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()}
    for _, block in hf_io.find_blocks(model, hf_io.model_block_class_names(model, hf_config.model_type)):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    model.to_empty(device=torch.device("cpu") if offload else device)
    load_sharded(model, path, layout)
    hf_io.restore_non_persistent_buffers(model, device)
    hf_io.move_buffers(model, device)  # buffers are not sharded: they stay on the compute device
    return model
