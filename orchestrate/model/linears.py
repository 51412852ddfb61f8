"""The linear layers of one transformer block per known family, with their (d_in, d_out), from a
`ModelShape` alone (no torch): what LoRA adapts ("target_modules: auto") and QLoRA quantizes.

Names are the modules' last name parts as in transformers' modeling files (what peft's
`target_modules` matches): models/llama/modeling_llama.py (LlamaAttention q/k/v/o_proj, LlamaMLP
gate/up/down_proj; mistral, qwen2 and gemma use the same names), models/phi3/modeling_phi3.py
(qkv_proj, o_proj, gate_up_proj, down_proj), models/gpt2/modeling_gpt2.py (Conv1D c_attn, c_proj
twice, c_fc).
"""

from __future__ import annotations

from orchestrate.model.shape import ModelShape

_LLAMA_LIKE = ("llama", "mistral", "qwen2", "gemma")


def block_linears(shape: ModelShape) -> list[tuple[str, int, int]] | None:
    """(name, d_in, d_out) of every linear layer of one block, or None for a family not listed here."""
    h, i, hd = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_heads * hd, shape.num_kv_heads * hd
    if shape.model_type in _LLAMA_LIKE:
        return [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h),
                ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]
    if shape.model_type == "phi3":
        return [("o_proj", q, h), ("qkv_proj", h, q + 2 * kv), ("gate_up_proj", h, 2 * i), ("down_proj", i, h)]
    if shape.model_type == "gpt2":
        return [("c_attn", h, 3 * h), ("c_proj", h, h), ("c_fc", h, i), ("c_proj", i, h)]
    return None


def linear_families() -> tuple[str, ...]:
    return (*_LLAMA_LIKE, "phi3", "gpt2")
