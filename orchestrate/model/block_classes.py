"""The transformer-block classes of a model type: what FSDP2 shards one by one and activation
checkpointing wraps (the model's `_no_split_modules`, the list accelerate and HF's device_map use
for the same purpose). Known families come from a table, so rendering a plan imports neither torch
nor transformers; others are looked up in transformers. The table equals transformers' own lists
(for encoders, those lists without the embeddings; docs/measurements.md#modelblock_classespy)."""

from __future__ import annotations

KNOWN_BLOCK_CLASSES = {
    "gpt2": ["GPT2Block"],
    "llama": ["LlamaDecoderLayer"],
    "mistral": ["MistralDecoderLayer"],
    "qwen2": ["Qwen2DecoderLayer"],
    "phi3": ["Phi3DecoderLayer"],
    "gemma": ["GemmaDecoderLayer"],
}

ENCODER_BLOCK_CLASSES = {
    "bert": ["BertLayer"],
    "roberta": ["RobertaLayer"],
    "distilbert": ["TransformerBlock"],
}
"""Encoders: the repeated layer only. Their `_no_split_modules` also names the embeddings module
(BertEmbeddings), which must not be an FSDP unit of its own: a masked LM's decoder is tied to the
word embeddings, and `fully_shard` on the embeddings alone swaps the shared Parameter for a DTensor
in that module only (the tie comes apart). The embeddings stay in the root unit with the decoder,
which is also what the planner's FSDP term assumes (root = everything outside the layers)."""


def block_class_names(model_type: str) -> list[str] | None:
    """The block classes of a built-in causal LM or encoder without building it: pure, for render().
    None for model types transformers does not ship (custom code) or whose class names none: ask the
    built model instead (`hf_io.model_block_class_names`)."""
    if model_type in KNOWN_BLOCK_CLASSES:
        return list(KNOWN_BLOCK_CLASSES[model_type])
    if model_type in ENCODER_BLOCK_CLASSES:
        return list(ENCODER_BLOCK_CLASSES[model_type])
    return transformers_block_class_names(model_type)


def transformers_block_class_names(model_type: str) -> list[str] | None:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, class_name, None) if class_name else None
    names = getattr(cls, "_no_split_modules", None)
    return sorted(names) if names else None
