"""The LoRA / QLoRA model transform (`train.method: lora | qlora`), with peft and bitsandbytes.

qlora first replaces every linear layer of the blocks by a bitsandbytes `Linear4bit` holding its
weights in NF4 (the same set of layers `orchestrate.model.linears.block_linears` counts for the
planner); then peft's `get_peft_model` freezes every base parameter and adds the adapters.
lora casts the frozen base to the training precision (the planner counts it there; fp32 on CPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrate.backends.registry import shards_parameters
from orchestrate.model.linears import block_linears

if TYPE_CHECKING:
    import torch

    from orchestrate.planner.plan import RunPlan

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def compute_dtype(plan: RunPlan) -> torch.dtype:
    import torch

    q = plan.config.train.quantization.compute_dtype
    return getattr(torch, _DTYPES[plan.strategy.precision if q == "auto" else q])


def target_modules(plan: RunPlan) -> list[str]:
    wanted = plan.config.train.lora.target_modules
    return sorted({name for name, _, _ in block_linears(plan.shape) or []}) if wanted == "auto" else list(wanted)


def quant_storage(plan: RunPlan) -> torch.dtype:
    """The dtype the packed NF4 bytes are stored as. uint8 by default; where the backend shards the base it
    must be the compute dtype, as transformers' `bnb_4bit_quant_storage` for FSDP-QLoRA: FSDP2's mixed
    precision casts every parameter to its param_dtype, uint8 codes too (bitsandbytes docs "FSDP-QLoRA";
    Answer.AI fsdp_qlora)."""
    import torch

    return compute_dtype(plan) if shards_parameters(plan.strategy.sharding) else torch.uint8


def nf4_linear(linear: torch.nn.Linear, weight: torch.Tensor, plan: RunPlan, device: torch.device) -> torch.nn.Module:
    """`linear` as a bitsandbytes NF4 `Linear4bit` on `device`, its `weight` quantized there (Params4bit.to
    quantizes on the first move to a non-meta device, CPU included: bitsandbytes/nn/modules.py
    Params4bit.to -> _quantize). The bias, if any, is carried over as it is (meta until read, for
    methods/lora/quantized_loading.py). The one place both the after-load transform and the load-time path build it."""
    import bitsandbytes as bnb
    import torch

    q = plan.config.train.quantization
    storage, dtype = quant_storage(plan), compute_dtype(plan)
    new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                            compute_dtype=dtype, quant_type=q.type, compress_statistics=q.double_quant,
                            quant_storage=storage, device="meta")
    # On a CPU with AVX512-BF16, Linear4bit.forward in eval mode repacks weight.data in place and flags the
    # quant state packed (bitsandbytes 0.50 nn/modules.py, _convert_weight_packed_for_cpu). Under FSDP2 the
    # next unshard brings the unpacked data back under that flag: evaluation and every step after it
    # computed garbage (QLoRA on 2 CPU ranks: eval loss 6.5 while training loss was 1.2). Off.
    new.support_avx512bf16_for_cpu = False
    # module=new: quantizing also records the quant state on the layer, where Linear4bit.forward
    # recovers it once FSDP2 has swapped the parameter for its unsharded copy (which lacks it).
    new.weight = bnb.nn.Params4bit(weight.to(dtype), requires_grad=False, quant_type=q.type,
                                   compress_statistics=q.double_quant, quant_storage=storage, module=new).to(device)
    if linear.bias is not None:
        new.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
    # On a CPU with AVX512-BF16, Linear4bit.forward in eval mode without grad rewrites weight.data in
    # place into its fused kernel's blocked layout and mutates the shared quant_state (absmax
    # transposed, rounded to bf16, double quantization undone), and nothing turns it back when training
    # resumes; dequantize_4bit then reads the blocked bytes as the plain layout (bitsandbytes/nn/
    # modules.py Linear4bit.forward, functional.py _convert_weight_packed_for_cpu). Evaluation keeps
    # the layout training uses.
    new.support_avx512bf16_for_cpu = False
    return new


def _quantize_block_linears(model: torch.nn.Module, plan: RunPlan) -> None:
    """Every nn.Linear inside the blocks becomes an NF4 `Linear4bit`. A linear already 4-bit (the base was
    quantized as it loaded, methods/lora/quantized_loading.py) is not an nn.Linear and is left as it is."""
    import torch

    from orchestrate.backends.hf_io import find_blocks, model_block_class_names

    classes = model_block_class_names(model, plan.shape.model_type)
    for _, block in find_blocks(model, classes):
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    # Quantized on the CPU (as before), then moved where the linear was.
                    new = nf4_linear(child, child.weight.data, plan, torch.device("cpu"))
                    setattr(parent, name, new.to(child.weight.device))


def add_adapters(model: torch.nn.Module, plan: RunPlan) -> torch.nn.Module:
    """The LoRA transform: the base frozen (quantized to NF4 first for qlora, else cast to the compute
    dtype), peft's adapters on the target linears, in train.lora.dtype (fp32 or bf16)."""
    import peft
    import torch

    lora = plan.config.train.lora
    if plan.config.train.method == "qlora":
        _quantize_block_linears(model, plan)
        # What transformers sets after a bitsandbytes load; peft reads it to wrap Linear4bit layers in
        # its 4-bit LoRA layer (peft/tuners/lora/bnb.py dispatch_bnb_4bit), not the generic one.
        model.is_loaded_in_4bit = True
    else:
        model.to(compute_dtype(plan))
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=target_modules(plan), task_type="CAUSAL_LM",
                             fan_in_fan_out=plan.shape.model_type == "gpt2")  # GPT-2's Conv1D is (in, out)
    model = peft.get_peft_model(model, config)
    adapter_dtype = torch.bfloat16 if lora.dtype == "bf16" else torch.float32  # train.lora.dtype
    for p in model.parameters():  # the planner's 16 B/param (fp32) or 8 (bf16)
        if p.requires_grad:
            p.data = p.data.to(adapter_dtype)
    return model
