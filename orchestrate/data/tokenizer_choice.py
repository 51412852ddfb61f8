"""Which tokenizer a config trains with: `data.tokenizer`, else the tokenizer inside a local
`model.name_or_path` directory, else the built-in byte tokenizer.

A pretrained model fine-tuned with byte ids sees ids that meant other tokens in pre-training: it
trains, but starts from no knowledge of a single word. So the model's own tokenizer is the
default, and training pretrained weights with the byte tokenizer warns.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from orchestrate.config.schema import RunConfig

_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")
"""What `AutoTokenizer.from_pretrained` needs at least one of (transformers tokenization_utils_base)."""
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


def tokenizer_dir_of(config: RunConfig) -> Path | None:
    """The tokenizer directory to use, or None for the byte tokenizer (warns for pretrained weights)."""
    if config.data.tokenizer:
        return config.resolve_path(config.data.tokenizer)
    model_dir = _local_model_dir(config)
    if model_dir is None:
        return None
    if any((model_dir / name).is_file() for name in _TOKENIZER_MARKERS):
        return model_dir
    if any(any(model_dir.glob(pattern)) for pattern in _WEIGHT_PATTERNS):
        warnings.warn(f"model.name_or_path {model_dir} has pretrained weights but no tokenizer: training it with "
                      "the built-in byte tokenizer, whose ids mean other tokens to this model; set data.tokenizer "
                      "to the model's tokenizer directory", UserWarning, stacklevel=2)
    return None


def _local_model_dir(config: RunConfig) -> Path | None:
    if config.model.name_or_path is None:
        return None
    path = config.resolve_path(config.model.name_or_path)
    return path if path.is_dir() else None
