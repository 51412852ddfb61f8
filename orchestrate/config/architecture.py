"""Sanity bounds for an inline `model.architecture`: transformers accepts any value for its config
fields, and the model built from them on the meta device then raises deep inside torch (a negative
dimension), or takes minutes to build (a million layers) before the planner sees it."""

from __future__ import annotations

from typing import Any

# Upper bounds well above the largest released models (Llama 3.1 405B: 126 layers, hidden 16,384,
# 128 heads, FFN 53,248, 128K positions; Gemma: 262,144 ids); past them a value is a typo.
_DIMENSIONS = {
    "num_hidden_layers": 1024, "n_layer": 1024,
    "hidden_size": 2**17, "n_embd": 2**17,
    "num_attention_heads": 4096, "n_head": 4096, "num_key_value_heads": 4096,
    "head_dim": 2**14,
    "intermediate_size": 2**20, "n_inner": 2**20,
    "vocab_size": 2**22,
    "max_position_embeddings": 2**24, "n_positions": 2**24, "n_ctx": 2**24,
}
_OPTIONAL = {"n_inner", "head_dim", "num_key_value_heads"}
"""Fields transformers reads null as "derive it" (GPT-2's n_inner = 4 * n_embd, and so on)."""


def architecture_problems(arch: dict[str, Any]) -> list[str]:
    """What is wrong with `arch`'s model_type and dimension fields, one message each."""
    problems = []
    model_type = arch.get("model_type")
    if not isinstance(model_type, str):
        problems.append(f"`model_type` must be a name such as gpt2 or llama, got {model_type!r}")
    for key, limit in _DIMENSIONS.items():
        if key not in arch or (arch[key] is None and key in _OPTIONAL):
            continue
        value = arch[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            problems.append(f"`{key}` must be a whole number from 1 to {limit:,}, got {value!r}")
    return problems
