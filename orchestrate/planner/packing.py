"""Packing whole chat / instruction samples apart (orchestrate/data/sft_samples.py): which attention
path keeps them apart, and what its mask costs. Pure.

Packed samples carry position ids that restart at 0 and no attention mask. On GPU plans the varlen
path transformers provides takes them: flash_attention_2 cuts its variable-length sequences from the
position ids (modeling_flash_attention_utils `_is_packed_sequence`, one row per micro-batch, as
`DataCollatorWithFlattening` feeds it), so no mask exists. Elsewhere (CPU, or a family without
flash-attention support) transformers builds a block-diagonal causal mask from the position ids
(masking_utils `find_packed_sequence_indices`) for sdpa, which costs memory quadratic in seq_len.

The mask costs, per micro-batch row and seq_len^2, 1 byte for the boolean mask plus about c bytes (the
compute dtype's) for each layer whose attention saved it for backward (every layer, or one with
activation checkpointing, plus one being recomputed), and a head-dependent rest growing with those
layers. The term, 2 + c (layers + 1) + h layers / 8, stays above what the storage counter sees on CPU
and within 2x of it (docs/measurements.md#plannerpackingpy). On a GPU sdpa's memory-efficient kernel
takes the mask too: c is 2 there (not checked on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrate.config.schema import RunConfig
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.model.shape import ModelShape
from orchestrate.planner.strategy import Strategy

VARLEN = "varlen"
BLOCK_MASK = "block-mask"
FLASH_ATTENTION_FAMILIES = frozenset({"gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2",
                                      "gemma3_text"})
"""Families whose transformers model declares `_supports_flash_attn` (transformers 5.24 modeling files)."""
_PLAIN_TEXT_SUFFIXES = (".txt", ".text", ".md")
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")


@dataclass(frozen=True)
class SamplePacking:
    attention: str
    """VARLEN or BLOCK_MASK."""
    certain: bool
    """False when the record format is detected from the data at launch (`auto`): the mask is counted
    in case the records turn out to be chat or instruction records (predict high)."""

    def describe(self) -> str:
        how = ("position ids + flash_attention_2 (varlen, no mask)" if self.attention == VARLEN else
               "position ids + a block-diagonal causal mask (sdpa)")
        when = "" if self.certain else " if the records are chat or instruction records (detected at launch)"
        return f"packing: whole samples kept apart by {how}{when}"


def _plain_text_files(config: RunConfig) -> bool:
    """Data that can only be plain text: the demo corpus, or .txt / .md files (compressed or not)."""
    d = config.data
    if d.generate_demo_corpus and not d.train_files and not d.datasets and d.dataset is None:
        return True
    names = [f.lower() for f in [*d.train_files, *(e.path for e in d.datasets)]]
    names = [n[: -len(z)] if (z := next((z for z in _COMPRESSION if n.endswith(z)), "")) else n for n in names]
    return bool(names) and all(n.endswith(_PLAIN_TEXT_SUFFIXES) for n in names)


def sample_packing(config: RunConfig, hw: HardwareProfile, shape: ModelShape) -> SamplePacking | None:
    """How this config's samples are packed apart, or None when its data is a packed stream of plain
    text (or padded, or no causal LM's)."""
    d = config.data
    if config.model.task != "causal-lm" or not d.packing or d.module is not None or config.model.module is not None:
        return None
    if d.record_format == "text" or d.template is not None or (d.record_format == "auto" and _plain_text_files(config)):
        return None
    varlen = hw.has_gpu and shape.model_type in FLASH_ATTENTION_FAMILIES
    return SamplePacking(VARLEN if varlen else BLOCK_MASK, certain=d.record_format != "auto")


def mask_bytes(packing: SamplePacking | None, shape: ModelShape, strategy: Strategy, seq_len: int,
               compute_bytes: int) -> int:
    """The block-diagonal mask's bytes at the peak (module doc); 0 on the varlen path."""
    if packing is None or packing.attention != BLOCK_MASK:
        return 0
    saved_layers = 1 if strategy.activation_checkpointing else shape.num_layers
    per_square = 2 + compute_bytes * (saved_layers + 1) + shape.num_heads * saved_layers / 8
    return int(strategy.micro_batch_size * seq_len * seq_len * per_square)
