"""The plan's backend applied to the user's own model and optimizer: DDP, FSDP2 `fully_shard` or a
DeepSpeed engine, with the plan's precision, offload and gradient clipping. Every setting comes from
the backend's own rendered settings (`ddp_settings`, `fsdp_settings`, `engine_config`), so the
ddp.json / fsdp.json / deepspeed.json in the run directory are what runs, as for the worker.

What the worker's backends do and this does not: build the model (the user did), their AdamW and
schedule (the user's optimizer is used; a scheduler the user made on it keeps working).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orchestrate.backends.ddp import ddp_settings
from orchestrate.backends.deepspeed_render import engine_config
from orchestrate.backends.fsdp import check_device, fsdp_settings
from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    import torch

    from orchestrate.planner.plan import RunPlan


def broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Every rank starts from rank 0's weights (as DDP does at construction): the user's model was
    built before the process group, so each rank may have drawn different initial values."""
    import torch.distributed as dist

    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)


def grad_scaler(plan: RunPlan, device: torch.device) -> Any:
    """fp16's dynamic loss scaling (ddp.json / fsdp.json "loss_scaling"); None otherwise. Sharded
    under FSDP2: the inf/nan check is all-reduced, so every rank skips the same steps."""
    if plan.strategy.precision != "fp16":
        return None
    if plan.strategy.backend == "fsdp":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)
    from torch.amp import GradScaler

    return GradScaler(device.type)


def _require_fresh(optimizer: torch.optim.Optimizer) -> None:
    if optimizer.state:
        raise UserError("orchestrate.prepare needs an optimizer that has not stepped yet", [Problem(
            "orchestrate.prepare(optimizer)", "it holds state for some parameters already",
            "create the optimizer, then call prepare before the first step (load a checkpoint with orchestrate.load)")])


def wrap_ddp(plan: RunPlan, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    import torch
    import torch.distributed as dist

    from orchestrate.backends import single_rank

    st = ddp_settings(plan)
    model.to(device)  # in place: the optimizer's parameters stay the same objects
    wrapped = single_rank.wrap(model, device, dist.get_world_size())
    if st["autocast_dtype"]:
        # fp32 weights and optimizer, forward under autocast (ddp.json), as accelerate does it.
        wrapped.forward = torch.autocast(device.type, dtype=getattr(torch, st["autocast_dtype"]))(wrapped.forward)
    return wrapped


def _blocks(model: torch.nn.Module, class_names: list[str] | None) -> list[torch.nn.Module]:
    """The modules to shard one by one: the plan's block classes where the model has them, else the
    entries of the model's largest ModuleList / Sequential (its repeated blocks); else none (root only)."""
    import torch

    named = [m for m in model.modules() if type(m).__name__ in (class_names or [])]
    if named:
        return named
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList | torch.nn.Sequential) and m is not model]
    largest = max(stacks, key=len, default=None)
    return [m for m in largest if any(p.requires_grad for p in m.parameters())] if largest is not None else []


def wrap_fsdp(plan: RunPlan, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              device: torch.device) -> torch.nn.Module:
    """fully_shard each block, then the root, with fsdp.json's mesh, resharding, mixed precision and
    offload; the optimizer's parameter groups are pointed at the sharded (DTensor) parameters."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    st = fsdp_settings(plan)
    check_device(st, device)
    _require_fresh(optimizer)
    names = {id(p): name for name, p in model.named_parameters()}
    mesh = init_device_mesh(st["device_type"], tuple(st["mesh"]["shape"]), mesh_dim_names=tuple(st["mesh"]["dim_names"]))
    mp = st["mixed_precision"]
    kwargs: dict[str, Any] = {
        "mesh": mesh, "reshard_after_forward": st["fully_shard"]["reshard_after_forward"],
        "mp_policy": MixedPrecisionPolicy(param_dtype=getattr(torch, mp["param_dtype"]),
                                          reduce_dtype=getattr(torch, mp["reduce_dtype"])) if mp else MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy() if st["cpu_offload"] else OffloadPolicy()}
    if not st["cpu_offload"]:
        model.to(device)
    for block in _blocks(model, st["fully_shard"]["block_classes"]):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # fully_shard replaces every parameter with a new DTensor one: the same swap accelerate makes
    # (fsdp2_switch_optimizer_parameters), by name, so groups and their hyper-parameters are kept.
    for group in optimizer.param_groups:
        group["params"] = [model.get_parameter(names[id(p)]) for p in group["params"]]
    return model


def wrap_deepspeed(plan: RunPlan, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """`deepspeed.initialize` with deepspeed.json (less its optimizer/scheduler blocks: the user's
    optimizer is the client optimizer). Returns the engine: it is the model, steps and accumulates."""
    import deepspeed

    _require_fresh(optimizer)
    # The user's optimizer may be one DeepSpeed has not tested with ZeRO (SGD, ...): theirs to choose.
    config = {**engine_config(plan), "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine
