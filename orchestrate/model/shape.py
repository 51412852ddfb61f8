"""The shape of a model, everything the planner needs, measured without weights.

Built by `orchestrate.model.meta.shape_from_config` on the meta device (no memory, no weights).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    """transformers `model_type` (gpt2, llama, mistral, qwen2, phi3, ...)."""
    parameters: int
    """Exact trainable parameter count, tied weights counted once."""
    largest_layer_parameters: int
    """Most parameters held directly by one module (DeepSpeed's `largest_layer_params`: usually
    the embedding); ZeRO-3 gathers at least this much at once."""
    embedding_parameters: int
    """Input embedding (+ position embedding) parameters."""
    lm_head_parameters: int
    """Output projection parameters not shared with the input embedding (0 when tied)."""
    block_parameters: int
    """Parameters of one transformer block (all blocks are the same shape)."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tied_embeddings: bool
    task: str = "causal-lm"
    """`model.task`; plans written before tasks existed read as causal-lm."""
    num_labels: int = 0
    """Classes of a sequence classifier (0 for the LM tasks)."""
    block_classes: tuple[str, ...] = ()
    """Your own module (task "custom"): the block classes to wrap (detected or strategy.wrap)."""
    activation_bytes_per_sample: int = 0
    """Your own module: fp32 activation bytes per sample, measured (methods/custom/activations.py)."""
    activation_bytes_fixed: int = 0
    """Your own module: the measured activation bytes that do not grow with the micro-batch."""

    @property
    def root_parameters(self) -> int:
        """Parameters outside the repeated blocks (embeddings, final norm, LM head): FSDP2's root unit,
        what a block-by-block gather keeps besides the blocks."""
        return max(0, self.parameters - self.num_layers * self.block_parameters)

    @property
    def matmul_parameters(self) -> int:
        """Parameters that take part in matrix multiplies: all but the input (and position) embedding
        lookups, plus the LM head when it is tied to the input embedding (counted once in P)."""
        tied_head = self.vocab_size * self.hidden_size if self.tied_embeddings else 0
        return self.parameters - self.embedding_parameters + tied_head

    @property
    def logits_width(self) -> int:
        """Columns of the head's output: the vocabulary for LM heads, num_labels for a classifier."""
        return self.num_labels if self.task == "sequence-classification" else self.vocab_size

    @property
    def logits_per_token(self) -> bool:
        """LM heads score every position; a classifier scores one pooled vector per sequence
        (BertForSequenceClassification: pooler -> classifier, modeling_bert.py)."""
        return self.task != "sequence-classification"

    def to_dict(self) -> dict:
        return {**asdict(self), "block_classes": list(self.block_classes)}  # JSON's form: what a checkpoint compares

    @classmethod
    def from_dict(cls, data: dict) -> ModelShape:
        return cls(**{**data, "block_classes": tuple(data.get("block_classes", ()))})
