"""Tokenizers: the built-in byte-level one (ids 0-255 are bytes, 256 ends a document) or a local
Hugging Face tokenizer directory. Both expose `encode`, `decode`, `eos_id`, `vocab_size`."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from orchestrate.errors import Problem, UserError

BYTE_EOS = 256
BYTE_VOCAB = 257


class Tokenizer(Protocol):
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids: no files, no training, any text round-trips exactly."""

    eos_id = BYTE_EOS
    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local `AutoTokenizer` directory (tokenizer.json etc.); documents end with its EOS token."""

    def __init__(self, directory: Path):
        from transformers import AutoTokenizer

        if not directory.is_dir():
            raise UserError(f"tokenizer directory {directory} not found",
                            [Problem("data.tokenizer", f"{directory} is not a directory",
                                     "point it at a local Hugging Face tokenizer directory, or remove it "
                                     "to use the built-in byte-level tokenizer")])
        try:
            self._tok = AutoTokenizer.from_pretrained(str(directory))
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot load the tokenizer in {directory}",
                            [Problem("data.tokenizer", str(exc).splitlines()[0],
                                     "the directory needs tokenizer.json or tokenizer_config.json")]) from None
        eos = self._tok.eos_token_id if self._tok.eos_token_id is not None else self._tok.sep_token_id
        if eos is None:
            raise UserError(f"the tokenizer in {directory} has no end-of-text token",
                            [Problem("data.tokenizer", "neither eos_token nor sep_token is set",
                                     "set eos_token in tokenizer_config.json")])
        self.eos_id = int(eos)
        # Whole documents are encoded and then packed, so a document longer than the model's context
        # is normal here; without this the tokenizer warns about every one of them.
        self._tok.model_max_length = 2**62
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(tokenizer_dir: Path | None) -> Tokenizer:
    return ByteTokenizer() if tokenizer_dir is None else HFTokenizer(tokenizer_dir)
