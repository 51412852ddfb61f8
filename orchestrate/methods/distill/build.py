"""Build the frozen distillation teacher on a worker, placed as the plan's chosen candidate says
(`Candidate.teacher_placement`, searched by the planner: orchestrate/methods/distill/memory.py). The same builder serves every student
backend: it runs before the backend's `setup`, so no `HfDeepSpeedConfig` of a ZeRO-3 student is
alive yet (while one is, transformers builds every model inside `deepspeed.zero.Init`: the teacher
would come out partitioned, with nothing to gather it for its forward).

- replicated: the whole teacher on this rank's device, filled tensor by tensor (loading/weights.py).
- sharded / offload: FSDP2 `fully_shard(reshard_after_forward=True)` per block and the root over
  all ranks, from the meta device, each rank reading only its own rows (as the FSDP backend loads
  the student); offload adds `CPUOffloadPolicy` (shards in CPU RAM, which needs an accelerator:
  on a CPU-only worker the replicated teacher is in host memory already).
Every parameter is frozen (`requires_grad=False`), the module in eval mode (no dropout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from orchestrate.planner.plan import Plan

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def teacher_placement(plan: Plan, device: torch.device, world_size: int) -> str:
    """The placement this worker builds: the plan's, with offload as replicated on a CPU device
    and sharding over one rank as replicated (nothing to split)."""
    from orchestrate.methods.distill.memory import resolve_placement

    placement = plan.chosen.teacher_placement or resolve_placement(plan.config.distill.placement,
                                                                    plan.chosen.strategy, world_size)
    if (placement == "offload" and device.type == "cpu") or (placement == "sharded" and world_size == 1):
        return "replicated"
    return placement


def build_teacher(plan: Plan, device: torch.device, world_size: int, placement: str) -> torch.nn.Module:
    import torch

    from orchestrate.loading.weights import load_replicated
    from orchestrate.methods.distill.teacher import teacher_dir

    dtype = getattr(torch, _DTYPES[plan.chosen.strategy.precision])
    path, trust, task = teacher_dir(plan.config), plan.config.model.trust_remote_code, plan.config.model.task
    if placement == "replicated":
        model = load_replicated(path, device, dtype, trust, task)
    else:
        model = _sharded(path, device, world_size, dtype, trust, task, offload=placement == "offload")
    model.requires_grad_(False)
    return model.eval()


def _sharded(path, device: torch.device, world_size: int, dtype, trust: bool, task: str,
             offload: bool) -> torch.nn.Module:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    from orchestrate.backends import hf_io
    from orchestrate.loading.weights import cast_floating_parameters, load_sharded, meta_model

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
