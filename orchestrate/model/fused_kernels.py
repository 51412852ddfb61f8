"""Liger-Kernel's fused RMSNorm, RoPE and gated MLP on a built model (`Strategy.fused_kernels`).

Each backend calls `apply_fused_kernels` right after the method built the model and before anything wraps
it (activation checkpointing, FSDP2's fully_shard, DeepSpeed's engine): liger's instance patching walks
`model.layers[i].mlp` and the norms by name, which a checkpoint wrapper would hide. It rebinds the modules'
`forward` only (no parameter changes), so a meta, sharded or quantized model is patched alike; RoPE is
patched in the family's modeling module, i.e. for every model of that family in this process (a worker
trains one model).

Liger's cross-entropy and fused-linear-cross-entropy stay off: the LM head and its loss are orchestrate's
(`train.loss_chunks`, the preference log-probabilities).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orchestrate.methods.lora.saving import is_peft

if TYPE_CHECKING:
    from orchestrate.planner.plan import RunPlan

# model_type -> (liger_kernel.transformers function, its keyword for the gated MLP): the planner's
# FUSED_FAMILIES (planner/long_context.py). Gemma's MLP is GeGLU (tanh GELU), the others SwiGLU; phi3's is
# one fused gate_up_proj (liger's Phi3 SwiGLU).
LIGER_PATCHES: dict[str, tuple[str, str]] = {
    "llama": ("apply_liger_kernel_to_llama", "swiglu"),
    "mistral": ("apply_liger_kernel_to_mistral", "swiglu"),
    "qwen2": ("apply_liger_kernel_to_qwen2", "swiglu"),
    "phi3": ("apply_liger_kernel_to_phi3", "swiglu"),
    "gemma": ("apply_liger_kernel_to_gemma", "geglu"),
}


def liger_call(model_type: str) -> tuple[str, dict[str, bool]]:
    """The liger function's name and keyword arguments for `model_type` (ValueError for another family)."""
    if model_type not in LIGER_PATCHES:
        raise ValueError(f"train.fused_kernels: Liger-Kernel has no fused kernels orchestrate applies to "
                         f"model_type {model_type!r} (supported: {', '.join(sorted(LIGER_PATCHES))}); "
                         "set train.fused_kernels: false")
    name, mlp = LIGER_PATCHES[model_type]
    return name, {"rope": True, "rms_norm": True, mlp: True, "cross_entropy": False,
                  "fused_linear_cross_entropy": False}


def hf_model(model: Any) -> Any:
    """The Hugging Face model under peft's wrappers (liger looks up `base_model_prefix` on what it is given)."""
    return model.get_base_model() if is_peft(model) else model


def apply_fused_kernels(plan: RunPlan, model: Any, device_type: str) -> None:
    """Where the plan's strategy turns fused kernels on, patch `model` (built, not yet wrapped) in place with
    Liger's kernels for its family."""
    if not plan.strategy.fused_kernels:
        return
    name, kwargs = liger_call(plan.shape.model_type)
    if device_type != "cuda":  # Triton kernels: a CPU rank would fail at its first forward, deep in Triton
        raise ValueError(f"train.fused_kernels: Liger-Kernel's Triton kernels need a CUDA GPU; this rank "
                         f"trains on {device_type}. Set train.fused_kernels: false")
    import liger_kernel.transformers as liger

    getattr(liger, name)(model=hf_model(model), **kwargs)
