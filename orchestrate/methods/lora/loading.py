"""Load a LoRA / QLoRA run's base for the backends that shard or move it (FSDP2, DeepSpeed ZeRO-2/3).

peft renames the adapted layers' keys (`...q_proj.base_layer.weight`) and NF4 packs the weights, so
neither FSDP2's sharded read by HF key (loading.load_sharded) nor ZeRO-3's `zero.Init` load can fill the
adapted model. Instead:

- QLoRA (safetensors): every rank quantizes its base as it loads, on the CPU (quantized_loading
  `load_quantized`, the storage dtype `lora.quant_storage` picks for the backend): the NF4 base plus one
  tensor in flight per rank, never the 16-bit base. The LoRA transform then adapts those Linear4bit
  layers as they are (it only replaces plain nn.Linear).
- LoRA under FSDP2: rank 0 alone reads the base in the compute dtype and transforms it (seeded, so its
  adapters' init is the one every rank would have drawn); every rank builds the same transformed model
  on the meta device, `fully_shard`s it, and `fill_from_rank0` broadcasts rank 0's full state dict
  tensor by tensor into the shards (torch.distributed.checkpoint.state_dict `set_model_state_dict`,
  broadcast_from_rank0). One 16-bit copy per node, on rank 0.
- LoRA under DeepSpeed: every rank reads the whole base in the compute dtype (`load_adapter_base`).

The planner's host terms: methods/lora/memory.py `quantized_load_bytes`, planner/memory.py `_load_bytes`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from orchestrate.methods.lora.transform import compute_dtype
from orchestrate.methods.registry import apply_transforms

if TYPE_CHECKING:
    from orchestrate.backends.hf_io import StateLayout
    from orchestrate.planner.plan import RunPlan


def load_adapter_base(model_dir: Path, plan: RunPlan, trust_remote_code: bool = False,
                      task: str = "causal-lm") -> tuple[nn.Module, StateLayout]:
    """The base on the CPU (QLoRA from safetensors: quantized as it loads; else whole in the compute dtype),
    untransformed, with the StateLayout of the unquantized model (checkpoints and the merged export use it)."""
    from orchestrate.backends.hf_io import StateLayout
    from orchestrate.loading.weights import has_safetensors, load_replicated
    from orchestrate.methods.lora.quantized_loading import load_quantized

    cpu = torch.device("cpu")
    if plan.config.train.method == "qlora" and has_safetensors(model_dir):
        return load_quantized(model_dir, cpu, plan, trust_remote_code, task)
    model = load_replicated(model_dir, cpu, compute_dtype(plan), trust_remote_code, task)
    return model, StateLayout.of(model)


def fsdp_adapter_model(model_dir: Path, plan: RunPlan, rank: int, trust_remote_code: bool = False,
                       task: str = "causal-lm") -> tuple[nn.Module, StateLayout, dict[str, torch.Tensor] | None]:
    """(the transformed model FSDP2's setup shards, the base's StateLayout, and for LoRA the full state dict
    `fill_from_rank0` broadcasts after fully_shard: rank 0's, {} elsewhere; None for QLoRA, filled already)."""
    from orchestrate.loading.weights import cast_floating_parameters, meta_model

    if plan.config.train.method == "qlora":
        model, layout = load_adapter_base(model_dir, plan, trust_remote_code, task)
        return apply_transforms(model, plan), layout, None
    full: dict[str, torch.Tensor] = {}
    if rank == 0:
        # Forked: rank 0 draws the adapters' init from the seeded state and leaves it as the others do
        # (their meta-device init draws nothing), so every rank's generator stays the same.
        with torch.random.fork_rng(devices=[]):
            full = apply_transforms(load_adapter_base(model_dir, plan, trust_remote_code, task)[0], plan).state_dict()
    model, _, layout = meta_model(Path(model_dir), trust_remote_code, task)
    cast_floating_parameters(model, compute_dtype(plan))  # as load_replicated casts rank 0's
    return apply_transforms(model, plan), layout, full


def fill_from_rank0(model: nn.Module, full: dict[str, torch.Tensor], device: torch.device) -> None:
    """Allocate a fully_shard'ed meta model's shards on `device` and fill them from rank 0's full state dict:
    torch broadcasts one tensor at a time and each rank keeps its own shard (set_model_state_dict,
    broadcast_from_rank0; the other ranks pass {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from orchestrate.backends.hf_io import restore_non_persistent_buffers

    model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    restore_non_persistent_buffers(model, device)
