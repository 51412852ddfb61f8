"""A small Hugging Face tokenizer the data tests build locally (no download). Not named tokenizers.py:
scripts run from tests/helpers (hf_trainer_script.py) would import it instead of the library."""

from __future__ import annotations

from pathlib import Path


def word_tokenizer(directory: Path, words: list[str]) -> Path:
    """A word-level PreTrainedTokenizerFast over `words` (ids 0 and 1: [UNK], <eos>) saved in `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="[UNK]").save_pretrained(directory)
    return directory
