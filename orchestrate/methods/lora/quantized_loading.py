"""Load a QLoRA base from safetensors, quantizing as it loads (`train.method: qlora`; DDP on the rank's
device, FSDP2 and DeepSpeed ZeRO-2/3 on the CPU before they shard or move it: methods/lora/loading.py).

`load_replicated` allocates the whole model in fp32 before the LoRA transform quantizes it: 4 B/param
on the device (32 GB for an 8B model, on an 8 GB card) or, on CPU, in RAM. Here the model stays on the
meta device and is filled one tensor at a time from the files' memory maps: the weight of every block
linear becomes a bitsandbytes NF4 `Params4bit`, quantized when it moves to the device
(bitsandbytes/nn/modules.py `Params4bit.to` -> `_quantize`); everything else is allocated in the compute
dtype (with embedding offload the input embedding's tensors are filled on the CPU instead, so the 16-bit
table never touches the GPU: loading/host_embedding.py). Host RAM at any moment: one tensor as read plus
its cast, and, when the device is the CPU, the quantized model (methods/lora/memory.py
`quantized_load_bytes`); never the 16-bit base.
This is what transformers' `from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True))`
does, shard by shard; it is not used because it also quantizes the LM head's neighbours by its own
rules and would not match the planner's (and `add_adapters`') set of block linears.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from orchestrate.loading.weights import meta_model, plan_reads
from orchestrate.methods.lora.transform import compute_dtype, nf4_linear

if TYPE_CHECKING:
    from orchestrate.backends.hf_io import StateLayout
    from orchestrate.planner.plan import RunPlan


def block_linear_names(model: nn.Module, plan: RunPlan) -> set[str]:
    """Qualified names of every nn.Linear inside the transformer blocks (what QLoRA stores in NF4)."""
    from orchestrate.backends.hf_io import find_blocks, model_block_class_names

    classes = model_block_class_names(model, plan.shape.model_type)
    return {f"{block_name}.{name}" for block_name, block in find_blocks(model, classes)
            for name, child in block.named_modules() if type(child) is nn.Linear}


def _fill(model: nn.Module, name: str, tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if attr in owner._parameters:
        old = owner._parameters[attr]
        value = tensor.to(device, dtype if old.is_floating_point() else old.dtype)
        owner._parameters[attr] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:  # a persistent buffer keeps its own dtype
        owner._buffers[attr] = tensor.to(device, owner._buffers[attr].dtype)


def _retie(model: nn.Module, tie_groups: tuple[tuple[str, ...], ...]) -> None:
    """Point every alias of a tied weight at the one member the files filled."""
    for group in tie_groups:
        filled = next(model.get_parameter(n) for n in group if not model.get_parameter(n).is_meta)
        for name in group:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, filled)


def load_quantized(model_dir: Path, device: torch.device, plan: RunPlan, trust_remote_code: bool = False,
                   task: str = "causal-lm") -> tuple[nn.Module, StateLayout]:
    """(the model on `device`: block linears in NF4, the rest in the compute dtype, read tensor by tensor;
    the StateLayout of the unquantized model, which checkpoints and the merged export are keyed by)."""
    from orchestrate.backends.hf_io import restore_non_persistent_buffers
    from orchestrate.loading.host_embedding import HOST, host_names

    model, _, layout = meta_model(Path(model_dir), trust_remote_code, task)
    reads = plan_reads(Path(model_dir), layout)  # every mismatch is one UserError before anything is read
    quantized, dtype = block_linear_names(model, plan), compute_dtype(plan)
    host = host_names(model, plan.strategy.embedding_offload)
    with torch.no_grad():
        for path, items in reads.reads.items():
            with safe_open(str(path), framework="pt") as f:
                for target, key in items:
                    owner_name, _, attr = target.rpartition(".")
                    if owner_name in quantized and attr == "weight":
                        parent, _, child = owner_name.rpartition(".")
                        setattr(model.get_submodule(parent), child, nf4_linear(
                            model.get_submodule(owner_name), f.get_tensor(key), plan, device))
                    else:
                        _fill(model, target, f.get_tensor(key), dtype, HOST if target in host else device)
    _retie(model, layout.tie_groups)
    restore_non_persistent_buffers(model, device)
    return model, layout
