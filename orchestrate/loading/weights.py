"""Load a Hugging Face model directory's safetensors without N full copies per node.

`from_pretrained` on every rank holds one full copy per rank in CPU RAM before the model moves to
its GPU: N copies per node at once. Here the model is built on the meta device (no memory), its
storage is allocated where it will live, and the files are read tensor by tensor from their memory
maps (the OS page cache holds each file once per node, however many ranks read it):

- `load_replicated` (DDP, DeepSpeed ZeRO-0/1/2): storage allocated on the rank's device in the load
  dtype (`to_empty`), then filled one tensor at a time. Extra CPU RAM per rank: one tensor.
- `load_sharded` (FSDP2, after `fully_shard` + `to_empty`): each rank reads only the rows of each
  tensor that its shard holds (`safe_open(...).get_slice`), straight into its local shard: no rank
  ever holds a full tensor and nothing is broadcast.

Both match the files against the model from the safetensors headers first (missing, unexpected and
mis-shaped tensors are one UserError), before any weight is read.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from orchestrate.backends.hf_io import (
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    StateLayout,
    _match_key,
    _weight_files,
    check_weights_match,
)
from orchestrate.errors import UserError
from orchestrate.loading.weight_files import damaged_weights
from orchestrate.model.meta import build_meta_model


@dataclass
class ReadPlan:
    """Which tensor of which file fills which state-dict key of the model."""

    reads: dict[Path, list[tuple[str, str]]]
    """file -> [(model key, key in the file)], in file order."""


def has_safetensors(model_dir: Path) -> bool:
    return (Path(model_dir) / SAFETENSORS_INDEX).is_file() or (Path(model_dir) / SAFETENSORS_FILE).is_file()


def plan_reads(model_dir: Path, layout: StateLayout) -> ReadPlan:
    """Match the files' tensors (headers only) to the model's state dict; UserError on any mismatch."""
    model_dir = Path(model_dir)
    reads: dict[Path, list[tuple[str, str]]] = defaultdict(list)
    found: set[str] = set()
    unexpected, wrong_shape = [], []
    for path in _weight_files(model_dir):
        try:
            opened = safe_open(str(path), framework="pt")
        except SafetensorError as exc:
            raise UserError(f"the model weights in {model_dir} cannot be read", [damaged_weights(path, exc)]) from None
        with opened as f:
            for key in f.keys():
                target = _match_key(key, layout)
                if target is None:
                    if not any(re.search(p, key) for p in layout.ignore_unexpected):
                        unexpected.append(key)
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                if shape != layout.tensors[target][0]:
                    wrong_shape.append(f"{key}: file {shape}, model {layout.tensors[target][0]}")
                    continue
                reads[path].append((target, key))
                found.add(target)
    for group in layout.tie_groups:  # HF writes a tied weight once; its aliases share the storage
        if found & set(group):
            found |= set(group)
    missing = sorted(set(layout.tensors) - found)
    check_weights_match(model_dir, missing, unexpected, wrong_shape)
    return ReadPlan(dict(reads))


def _retie(model: nn.Module, layout: StateLayout) -> None:
    """`to_empty` gives every module its own new Parameter, so tied weights (GPT-2's lm_head and
    wte) come apart; point every alias back at the group's first Parameter."""
    for group in layout.tie_groups:
        first = model.get_parameter(group[0])
        for name in group[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)


def meta_model(model_dir: Path, trust_remote_code: bool = False,
               task: str = "causal-lm") -> tuple[nn.Module, object, StateLayout]:
    """(model on the meta device, its HF config, its StateLayout) for `model_dir/config.json`."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    model = build_meta_model(hf_config, task=task, trust_remote_code=trust_remote_code)
    return model, hf_config, StateLayout.of(model)


def cast_floating_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters in `dtype`; buffers keep theirs (rotary inv_freq stays fp32), as DeepSpeed's own
    cast of the module does. Free on the meta device, before anything is allocated."""
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)


def load_replicated(model_dir: Path, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False,
                    task: str = "causal-lm", host_embedding: bool = False) -> nn.Module:
    """The whole model on `device`, floating parameters in `dtype`, filled from `model_dir` one tensor at a time;
    `host_embedding`: the input embedding allocated and filled on the CPU instead (loading/host_embedding.py)."""
    from orchestrate.backends.hf_io import restore_non_persistent_buffers
    from orchestrate.loading.host_embedding import allocate

    model_dir = Path(model_dir)
    model, _, layout = meta_model(model_dir, trust_remote_code, task)
    plan = plan_reads(model_dir, layout)  # before allocating anything
    cast_floating_parameters(model, dtype)  # on meta: free
    allocate(model, device, host_embedding)
    _retie(model, layout)
    targets = model.state_dict()  # detached views of the parameters' storage
    with torch.no_grad():
        for path, items in plan.reads.items():
            with safe_open(str(path), framework="pt") as f:
                for target, key in items:
                    targets[target].copy_(f.get_tensor(key))  # casts and moves; the temporary is one tensor
    restore_non_persistent_buffers(model, device)
    return model


def load_sharded(model: nn.Module, model_dir: Path, layout: StateLayout) -> None:
    """Fill a `fully_shard`ed, `to_empty`-allocated model: each rank reads its own rows only."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    plan = plan_reads(Path(model_dir), layout)
    targets = model.state_dict()  # sharded parameters as DTensors; buffers as plain tensors
    with torch.no_grad():
        for path, items in plan.reads.items():
            with safe_open(str(path), framework="pt") as f:
                for target, key in items:
                    dst = targets[target]
                    if isinstance(dst, DTensor):
                        # torch's own helper for "which part of the global tensor is mine" (used by
                        # torch.distributed.checkpoint's state-dict distribution for the same purpose).
                        shape, offset = compute_local_shape_and_global_offset(dst.shape, dst.device_mesh,
                                                                              dst.placements)
                        rows = f.get_slice(key)[tuple(slice(o, o + s) for s, o in zip(shape, offset, strict=True))]
                        dst.to_local().copy_(rows)
                    else:
                        dst.copy_(f.get_tensor(key))
