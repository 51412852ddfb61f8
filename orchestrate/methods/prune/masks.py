"""Pruning masks on the weights as each rank holds them, for every strategy (docs/pruning.md).

A weight is seen as a `Pruned`: a flat view of this rank's elements of the module's copy plus their
offset in the full weight, and the extra copies the optimizer steps (the fp32 master) to mask too:
- DDP, DeepSpeed ZeRO-0 in fp32: the full parameter, replicated; nothing else.
- FSDP2: the DTensor's local shard (`to_local()`), which is also what the optimizer steps. Masks are
  applied to the shards after the optimizer step: gradient hooks registered before `fully_shard`
  would be silently dropped, and no hook is needed when the weights are re-masked.
- DeepSpeed ZeRO-1/2 (and the bf16 optimizer): the full module parameter, plus this rank's fragment
  of the flat fp32 partition (`param._hp_mapping`, what deepspeed.utils.safe_set_full_fp32_param
  writes); without the latter the master stays dense and the weights grow back at the next step.
- DeepSpeed ZeRO-3: the partition `param.ds_tensor` and its fp32 partition, through
  deepspeed.utils.safe_get/set_local_fp32_param.

Thresholds are exact and distributed without gathering weights: a bisection over the int32 bit
patterns of |w| (non-negative floats order like their bits), one all-reduced count per round, 31
rounds. Replicated copies count `replication` times, which the target counts are scaled by.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from orchestrate.methods.prune.schedule import pruned_count

_INF_BITS = 0x7F800000  # the bits of +inf: above every finite |w|
_LAYER = re.compile(r"\.(\d+)\.")


@dataclass
class Pruned:
    name: str
    kind: str
    """The linear's last name part (gate_proj, c_attn, ...)."""
    layer: int
    shape: tuple[int, ...]
    local: torch.Tensor
    """Flat view of this rank's elements of the module's copy (no padding)."""
    offset: int
    """Flat index of local[0] in the full weight."""
    masters: list[Callable[[torch.Tensor], None]] = field(default_factory=list)
    """Mask the other copies the optimizer steps, given this view's bool mask."""


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while isinstance(getattr(model, "module", None), torch.nn.Module):  # DDP, DeepSpeedEngine
        model = model.module
    return model


def _zero3_master(p: torch.nn.Parameter, valid: int) -> Callable[[torch.Tensor], None]:
    from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

    def apply(mask: torch.Tensor) -> None:
        fp32 = safe_get_local_fp32_param(p).flatten()  # the whole partition, padding included
        fp32[:valid].masked_fill_(~mask.to(fp32.device), 0)
        safe_set_local_fp32_param(p, fp32)
    return apply


def _fragment_master(p: torch.nn.Parameter) -> Callable[[torch.Tensor], None]:
    def apply(mask: torch.Tensor) -> None:
        mapping = p._hp_mapping
        if mapping is None:  # this rank owns no fragment of the parameter
            return
        address = mapping.lp_fragment_address
        frag = mapping.get_hp_fragment().view(-1)
        frag.masked_fill_(~mask.narrow(0, address.start, address.numel).to(frag.device), 0)
    return apply


def _view(name: str, kind: str, p: torch.nn.Parameter) -> Pruned:
    from torch.distributed.tensor import DTensor

    layer = int(m.group(1)) if (m := _LAYER.search(name)) else -1
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, start = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        row = torch.Size(p.shape[1:]).numel()
        return Pruned(name, kind, layer, tuple(p.shape), p.to_local().view(-1), start[0] * row)
    if hasattr(p, "ds_tensor"):  # ZeRO-3: a flat partition of ds_numel, the last one padded
        part = p.ds_tensor.numel()
        offset = dist.get_rank() * part
        valid = max(0, min(part, p.ds_numel - offset))
        return Pruned(name, kind, layer, tuple(p.ds_shape), p.ds_tensor.data.view(-1)[:valid], offset,
                      [_zero3_master(p, valid)])
    masters = [_fragment_master(p)] if hasattr(p, "_hp_mapping") else []
    return Pruned(name, kind, layer, tuple(p.shape), p.data.view(-1), 0, masters)


def prunable_views(model: torch.nn.Module, kinds: set[str]) -> list[Pruned]:
    """The weights of the block linears named `kinds` (modules inside a numbered block)."""
    out = []
    for name, module in unwrap(model).named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in kinds and _LAYER.search(name) and isinstance(getattr(module, "weight", None), torch.nn.Parameter):
            out.append(_view(f"{name}.weight", kind, module.weight))
    return out


def _all_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, on a device the process group reduces on (NCCL: this rank's GPU, whatever
    device the weights are on: FSDP2's and ZeRO's CPU offload keep them on the host)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
    out = t.to(device)
    dist.all_reduce(out)
    return out.to(t.device)


def replication(views: list[Pruned]) -> int:
    """How many ranks hold each element (world size when replicated, 1 when fully sharded)."""
    local = torch.tensor([sum(v.local.numel() for v in views)], dtype=torch.float64)
    full = sum(torch.Size(v.shape).numel() for v in views)
    return max(1, round(_all_sum(local).item() / full))


def _bits(v: Pruned) -> torch.Tensor:
    return v.local.detach().float().abs().view(torch.int32)


def _thresholds(views: list[Pruned], groups: list[int], targets: torch.Tensor, rep: int) -> torch.Tensor:
    """Per group g, the smallest int32 bit pattern T with #{|w| <= T} >= targets[g] over all ranks."""
    lo = torch.full_like(targets, -1)
    hi = torch.full_like(targets, _INF_BITS)
    while bool((hi - lo > 1).any()):
        mid = (lo + hi) // 2
        counts = torch.zeros_like(targets)
        for v, g in zip(views, groups, strict=True):
            counts[g] += int((_bits(v) <= mid[g].item()).sum())
        below = _all_sum(counts) >= targets * rep
        hi, lo = torch.where(below, mid, hi), torch.where(below, lo, mid)
    return hi


def magnitude_masks(views: list[Pruned], sparsity: float, per_layer: bool, rep: int) -> list[torch.Tensor]:
    """Keep |w| above the threshold that prunes `sparsity` of the weights: one threshold over all of
    them (global) or one per weight matrix (per-layer)."""
    sizes = [torch.Size(v.shape).numel() for v in views]
    if per_layer:
        groups = list(range(len(views)))
        targets = torch.tensor([pruned_count(sparsity, n) for n in sizes], dtype=torch.int64)
    else:
        groups = [0] * len(views)
        targets = torch.tensor([pruned_count(sparsity, sum(sizes))], dtype=torch.int64)
    thresholds = _thresholds(views, groups, targets, rep)
    return [(_bits(v) > thresholds[g].item()) | (targets[g] == 0) for v, g in zip(views, groups, strict=True)]


def _unit_of(v: Pruned, head_dim: int) -> tuple[str, torch.Tensor]:
    """Which structure each local element belongs to: the MLP channel (rows of gate/up_proj (i, h),
    columns of down_proj (h, i)) or the query head (rows of q_proj, columns of o_proj, d each)."""
    index = torch.arange(v.offset, v.offset + v.local.numel(), device=v.local.device)
    cols = v.shape[1]
    if v.kind in ("gate_proj", "up_proj"):
        return "mlp", index // cols
    if v.kind == "down_proj":
        return "mlp", index % cols
    return "heads", (index // cols if v.kind == "q_proj" else index % cols) // head_dim


def structured_masks(views: list[Pruned], sparsity: float, channels: int, heads: int = 0, kv_heads: int = 1,
                     head_dim: int = 1) -> list[torch.Tensor]:
    """Per block, drop the MLP channels with the smallest L2 norm over gate row + up row + down
    column, and (heads > 0) in every key/value group the query heads with the smallest norm over
    their q_proj rows + o_proj columns. Scores are summed over ranks (replicas only scale them)."""
    layers = sorted({v.layer for v in views})
    device = views[0].local.device
    scores = {"mlp": torch.zeros(len(layers), channels, dtype=torch.float64, device=device)}
    if heads:
        scores["heads"] = torch.zeros(len(layers), heads, dtype=torch.float64, device=device)
    for v in views:
        kind, unit = _unit_of(v, head_dim)
        scores[kind][layers.index(v.layer)].index_add_(0, unit, v.local.detach().double() ** 2)
    keep = {}
    for kind, score in scores.items():
        score = _all_sum(score)
        groups = score.view(len(layers), kv_heads, -1) if kind == "heads" else score.unsqueeze(1)
        drop = pruned_count(sparsity, groups.shape[-1])
        kept = torch.ones_like(groups, dtype=torch.bool)
        kept.scatter_(2, torch.argsort(groups, dim=2, stable=True)[..., :drop], False)
        keep[kind] = kept.view(len(layers), -1)
    out = []
    for v in views:
        kind, unit = _unit_of(v, head_dim)
        out.append(keep[kind][layers.index(v.layer)][unit])
    return out


@torch.no_grad()
def apply_masks(views: list[Pruned], masks: list[torch.Tensor]) -> None:
    """Zero the pruned elements in the module's copy and in every master copy."""
    for v, mask in zip(views, masks, strict=True):
        v.local.masked_fill_(~mask, 0)
        for master in v.masters:
            master(mask)


def measured_sparsity(views: list[Pruned], rep: int) -> float:
    """The share of exact zeros over every pruned weight, all ranks together."""
    zeros = torch.tensor([sum(int((v.local == 0).sum()) for v in views)], dtype=torch.float64)
    total = sum(torch.Size(v.shape).numel() for v in views)
    return _all_sum(zeros).item() / rep / total
