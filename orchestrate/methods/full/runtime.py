"""Full fine-tuning on the worker: the Hugging Face model built from the model directory as each
backend asks (orchestrate/backends/base.py ModelRequest), never N full copies per node.

- replicated (DDP): allocated on the rank's device in fp32 and filled tensor by tensor from the
  safetensors (orchestrate/loading/weights.py); PyTorch .bin weights through transformers' loader (a
  full copy per rank); no weights at all: built from its config, seeded (Backend.reads_weights).
- sharded (FSDP2): built on the meta device; after `fully_shard` every rank allocates its shards (on
  the CPU when offloaded) and reads only its rows of each tensor.
- engine (DeepSpeed): ZeRO-3 builds it inside `deepspeed.zero.Init` (HfDeepSpeedConfig) and loads it
  shard by shard into the partitions; ZeRO-0/1/2 load it whole on the device in the training dtype.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig

from orchestrate.backends import hf_io
from orchestrate.backends.base import BuiltModel, ModelRequest, TrainEngine
from orchestrate.backends.rank import Rank
from orchestrate.loading.init_weights import build_from_config, has_weights
from orchestrate.loading.weights import has_safetensors, load_replicated, load_sharded
from orchestrate.methods.registry import apply_transforms
from orchestrate.methods.runtime import MethodRuntime
from orchestrate.model.meta import build_meta_model
from orchestrate.model.tasks import auto_class
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import RunDir


def materialise_sharded(model: torch.nn.Module, request: ModelRequest, layout: hf_io.StateLayout) -> None:
    """Allocate a fully_shard'ed meta model and read every rank's rows of each tensor from the safetensors."""
    # Offloaded shards live in CPU memory; FSDP moves them to the GPU per block (torchtitan's init).
    model.to_empty(device=torch.device("cpu") if request.cpu_offload else request.device)
    for group in layout.tie_groups:  # fully_shard and to_empty keep tied Parameters one object
        params = {id(model.get_parameter(name)) for name in group}
        if len(params) != 1:
            raise RuntimeError(f"tied weights {group} came apart during sharding")
    load_sharded(model, request.model_dir, layout)
    hf_io.restore_non_persistent_buffers(model, request.device)


def load_whole(plan: RunPlan, request: ModelRequest, dtype: torch.dtype) -> torch.nn.Module:
    """The whole model on the request's device: from safetensors tensor by tensor, from .bin weights
    through transformers (fp32, a full copy per rank in CPU RAM), or built from its config."""
    trust, task, model_dir = plan.config.model.trust_remote_code, plan.config.model.task, request.model_dir
    if has_safetensors(model_dir):
        return load_replicated(model_dir, request.device, dtype, trust, task, request.embedding_offload)
    if has_weights(model_dir):  # PyTorch .bin weights: transformers' loader, a full fp32 copy per rank
        return auto_class(task).from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=trust)
    # trained from its config (Backend.reads_weights): built here, seeded by the backend, as init_weights would
    return build_from_config(model_dir, task, trust)


class FullRuntime(MethodRuntime):
    def build_model(self, plan: RunPlan, request: ModelRequest) -> BuiltModel:
        trust, task = plan.config.model.trust_remote_code, plan.config.model.task
        if request.layout == "sharded":
            hf_config = AutoConfig.from_pretrained(request.model_dir, trust_remote_code=trust)
            model = apply_transforms(build_meta_model(hf_config, task=task, trust_remote_code=trust), plan)
            layout = hf_io.StateLayout.of(model)  # before any wrapper renames modules
            return BuiltModel(model, hf_config, layout, fill=lambda m: materialise_sharded(m, request, layout))
        if request.layout == "replicated":
            model = load_whole(plan, request, request.dtype)
            layout = hf_io.StateLayout.of(model)  # before any transform or wrapper renames modules
            model = apply_transforms(model, plan)
            return BuiltModel(model, model.config, layout)
        keep_alive = None
        if request.zero_init is not None:
            from transformers.integrations import HfDeepSpeedConfig

            # While this object lives, from_pretrained builds the model inside deepspeed.zero.Init
            # (parameters partitioned as each module is created, onto offload_param's device) and
            # loads the checkpoint shard by shard into the partitions: no rank ever holds the whole
            # model. transformers keeps only a weakref, so the engine keeps it alive.
            keep_alive = HfDeepSpeedConfig(request.zero_init)
            # fp32 on purpose: zero.Init casts to bf16/fp16 itself as it partitions, and the fp32
            # master partitions are built from that cast copy (stage3.py), as under the HF Trainer.
            model = auto_class(task).from_pretrained(request.model_dir, dtype=torch.float32, trust_remote_code=trust)
        elif has_safetensors(request.model_dir):
            # Stages 0-2 replicate parameters: allocate them on this rank's device and fill them one
            # tensor at a time (loading/weights.py), never a full copy in CPU RAM per rank. In the training
            # dtype: the engine would cast the parameters to it anyway (_cast_module_mixed_precision) and
            # builds the fp32 master from that cast copy (stage_1_and_2.py), so the result is the same and
            # the device holds half the bytes.
            model = load_replicated(request.model_dir, request.device, request.dtype, trust, task)
        else:  # PyTorch .bin weights: transformers' loader, one full fp32 copy per rank in CPU RAM
            model = auto_class(task).from_pretrained(request.model_dir, dtype=torch.float32, trust_remote_code=trust)
        model.config.use_cache = False  # a KV cache is useless in training and clashes with checkpointing
        return BuiltModel(apply_transforms(model, plan), model.config, keep_alive=keep_alive)

    def save(self, plan: RunPlan, engine: TrainEngine, run: RunDir, rank: Rank) -> list[str]:
        engine.save_hf_model(run.model)  # every weight trained: the model as it trains
        return []


RUNTIME = FullRuntime()
