"""What a LoRA / QLoRA run writes: the adapter in PEFT format, and the model merged into a
full-precision base (Hugging Face layout, the keys of the model before the transform), both from
the adapters the engine gathers (`TrainEngine.model_state(trainable_only=True)`) and the base
re-read from the initial weights.

Merging dequantizes first: a QLoRA base is NF4, and peft's `merge_and_unload` on a 4-bit layer
re-quantizes the sum (peft/tuners/lora/bnb.py `Linear4bit.merge`), which rounds the merged weight
again. Here each adapted weight becomes dequantize(W) + B·A·alpha/r in fp32 (`_dense_weight`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.backends.base import trainable_state
from orchestrate.methods.lora.transform import compute_dtype
from orchestrate.methods.registry import apply_transforms

if TYPE_CHECKING:
    import torch

    from orchestrate.backends.base import TrainEngine
    from orchestrate.backends.hf_io import StateLayout
    from orchestrate.planner.plan import RunPlan
    from orchestrate.run.layout import RunDir

_PEFT_PREFIX = "base_model.model."


def is_peft(model) -> bool:
    # By lineage: fully_shard swaps a module's class for a subclass defined in torch (FSDPPeftModel...).
    return any(cls.__module__.startswith("peft.") for cls in type(model).__mro__)


def load_adapters(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` (adapters only) into a PEFT model; every adapter must be there, nothing else."""
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(trainable_state(model)) - set(state):
        raise RuntimeError(f"the adapters do not match the model: unexpected {result.unexpected_keys[:3]}, "
                           f"missing {sorted(set(trainable_state(model)) - set(state))[:3]}")


def _dense_weight(layer) -> torch.Tensor:
    import bitsandbytes as bnb

    weight = layer.weight
    if isinstance(weight, bnb.nn.Params4bit):
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    return weight.detach().float()


def merged_state_dict(model, keys) -> dict[str, torch.Tensor]:
    """The base's state dict under `keys` (the untransformed model's: `StateLayout.tensors`) with every
    adapter merged in, fp32, on CPU."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    merged: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            key = name.removeprefix(_PEFT_PREFIX)
            base = module.get_base_layer()
            delta = sum(module.get_delta_weight(a).float() for a in module.active_adapters)
            out[f"{key}.weight"] = (_dense_weight(base) + delta).cpu()
            if base.bias is not None:
                out[f"{key}.bias"] = base.bias.detach().float().cpu()
            merged.add(f"{key}.")
    for name, p in model.get_base_model().named_parameters(remove_duplicate=False):
        key = name.replace(".base_layer.", ".")
        if "lora_" not in name and not any(key.startswith(m) for m in merged):
            out[key] = p.detach().cpu().float()  # cast on the host: an fp32 copy of an 8B model's embedding is 2 GiB
    for name, b in model.get_base_model().named_buffers():
        out.setdefault(name, b.detach().cpu())
    if missing := [k for k in keys if k not in out]:
        raise RuntimeError(f"merged state dict lacks {missing[:3]} ({len(missing)} keys)")
    return {k: out[k] for k in keys}


def adapted_base(plan: RunPlan, model_dir: Path, adapters: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, StateLayout]:
    """The run's frozen base re-read from `model_dir` and transformed as in training (NF4 quantization
    is deterministic, so these are the bytes that trained), with `adapters` loaded, in this process on
    the CPU, and the base's layout (its keys and ties). One copy of the model in CPU memory.

    Never the live model's base: a sharding backend's is not whole in one process, and a library
    may have changed a 4-bit weight's layout in place."""
    import torch

    from orchestrate.backends.hf_io import StateLayout
    from orchestrate.loading.weights import load_replicated

    # In the compute dtype the sharding backends load it in, so the NF4 codes are the trained ones.
    model = load_replicated(model_dir, torch.device("cpu"), compute_dtype(plan), plan.config.model.trust_remote_code,
                            plan.config.model.task)
    layout = StateLayout.of(model)  # before the transform renames the adapted layers
    model = apply_transforms(model, plan)
    load_adapters(model, adapters)
    return model, layout


def merge_adapters(plan: RunPlan, model_dir: Path, adapters: dict[str, torch.Tensor]) -> tuple[dict, StateLayout]:
    """The merged full-precision state dict of a run's adapters (`adapted_base`, plus the merged copy in
    fp32), and the base's layout: for `orchestrate export --merge`."""
    model, layout = adapted_base(plan, model_dir, adapters)
    return merged_state_dict(model, layout.tensors), layout


def save_adapter(model, out_dir: Path, state: dict[str, torch.Tensor]) -> None:
    """adapter_config.json + adapter_model.safetensors: `PeftModel.from_pretrained(base, out_dir)` loads it.
    `state`: the adapters (the model's trainable state)."""
    from orchestrate.backends.hf_io import follow_umask

    model.save_pretrained(str(out_dir), safe_serialization=True, state_dict=state)
    follow_umask(Path(out_dir))


def save_merged_and_adapter(plan: RunPlan, engine: TrainEngine, run: RunDir, main: bool) -> None:
    """RUN_DIR/model, the adapters merged into the re-read base (full precision, the base's keys), and
    RUN_DIR/adapter in PEFT format, from rank 0. Collective: the engine gathers the adapters."""
    import torch.distributed as dist

    from orchestrate.backends.hf_io import save_hf_dir

    adapters = engine.model_state(trainable_only=True)
    if main:
        model, layout = adapted_base(plan, engine.model_dir, adapters)
        save_hf_dir(merged_state_dict(model, layout.tensors), engine.hf_config, run.model, layout)
        save_adapter(model, run.adapter, adapters)
    dist.barrier()
