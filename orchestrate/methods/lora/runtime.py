"""LoRA / QLoRA on the worker: the base loaded as each backend needs it (loading.py,
quantized_loading.py), the adapters added (transform.py), the model merged and the adapter beside it
saved (saving.py).

- replicated (DDP): QLoRA's base quantized tensor by tensor as it loads onto the device (never the
  fp32 base); LoRA's loaded as full training loads it, then cast by the transform.
- sharded (FSDP2): QLoRA's base quantized as it loads on the CPU on every rank; LoRA's read whole by
  rank 0 alone and broadcast into the shards after `fully_shard` (`fill`).
- engine (DeepSpeed): the base on the CPU (QLoRA quantized as it loads, LoRA in the compute dtype)
  before `deepspeed.initialize` moves or partitions it; the adapters drawn under the seed on every
  rank alike (ZeRO-3 keeps each rank's slice).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig

from orchestrate.backends.base import BuiltModel, ModelRequest, TrainEngine
from orchestrate.backends.hf_io import StateLayout
from orchestrate.backends.rank import Rank
from orchestrate.loading.weights import has_safetensors
from orchestrate.methods.full.runtime import load_whole
from orchestrate.methods.lora.loading import fill_from_rank0, fsdp_adapter_model, load_adapter_base
from orchestrate.methods.lora.quantized_loading import load_quantized
from orchestrate.methods.lora.saving import save_merged_and_adapter
from orchestrate.methods.lora.transform import add_adapters
from orchestrate.methods.registry import apply_transforms
from orchestrate.methods.runtime import MethodRuntime
from orchestrate.model.tasks import auto_class
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import RunDir


class _FromRank0:
    """Fills the shards from rank 0's full state dict once, then lets it go (rank 0's whole base)."""

    def __init__(self, state: dict[str, torch.Tensor], device: torch.device) -> None:
        self.state, self.device = state, device

    def __call__(self, model: torch.nn.Module) -> None:
        state, self.state = self.state, None
        fill_from_rank0(model, state, self.device)


class LoraRuntime(MethodRuntime):
    def transform(self, model: torch.nn.Module, plan: RunPlan) -> torch.nn.Module:
        return add_adapters(model, plan)

    def build_model(self, plan: RunPlan, request: ModelRequest) -> BuiltModel:
        trust, task, model_dir = plan.config.model.trust_remote_code, plan.config.model.task, request.model_dir
        if request.layout == "replicated":
            if plan.config.train.method == "qlora" and has_safetensors(model_dir):
                # Quantized tensor by tensor as it loads: never the fp32 base (quantized_loading.py); the
                # layout is the unquantized model's.
                model, layout = load_quantized(model_dir, request.device, plan, trust, task)
            else:
                model = load_whole(plan, request, request.dtype)
                layout = StateLayout.of(model)  # before the transform renames the adapted layers
            model = apply_transforms(model, plan)
            return BuiltModel(model, model.config, layout)
        if request.layout == "sharded":
            hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust)
            # QLoRA: each rank's base quantized as it loads on the CPU; LoRA: a meta model, filled from rank 0's
            # after fully_shard (loading.py). layout: the base's keys, the merged model's.
            model, layout, rank0_state = fsdp_adapter_model(model_dir, plan, request.rank, trust, task)
            fill = None if rank0_state is None else _FromRank0(rank0_state, request.device)
            return BuiltModel(model, hf_config, layout, fill=fill)
        if has_safetensors(model_dir):
            model = load_adapter_base(model_dir, plan, trust, task)[0]
        else:  # PyTorch .bin weights: transformers' loader, one full fp32 copy per rank in CPU RAM
            model = auto_class(task).from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=trust)
        model.config.use_cache = False  # a KV cache is useless in training and clashes with checkpointing
        torch.manual_seed(plan.config.train.seed)  # peft draws lora_A at random: every rank must draw the same
        return BuiltModel(apply_transforms(model, plan), model.config)

    def save(self, plan: RunPlan, engine: TrainEngine, run: RunDir, rank: Rank) -> list[str]:
        save_merged_and_adapter(plan, engine, run, rank.is_main)
        return [f"adapter: {run.adapter}"]


RUNTIME = LoraRuntime()
