"""Tokenizers: the built-in byte-level one (ids 0-255 are bytes, 256 ends a document) or a local
Hugging Face tokenizer directory. Both expose `encode`, `encode_batch`, `decode`, `eos_id`,
`vocab_size` and `fingerprint` (what the data cache key records about the tokenizer)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Protocol

import numpy as np

from orchestrate.config.model import TRUST_SWITCH
from orchestrate.errors import Problem, UserError

BYTE_EOS = 256
BYTE_VOCAB = 257


class Tokenizer(Protocol):
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int] | np.ndarray]: ...

    def decode(self, ids: list[int]) -> str: ...

    def fingerprint(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids: no files, no training, any text round-trips exactly."""

    eos_id = BYTE_EOS
    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # frombuffer: one C-level copy per document instead of a Python int per byte.
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "byte-utf8-v1"


class HFTokenizer:
    """A local `AutoTokenizer` directory (tokenizer.json etc.); documents end with its EOS token.

    Loading it imports transformers and tokenizers (seconds), yet a data-cache hit needs only its
    `fingerprint`, `vocab_size` and `eos_id`. With `memo_dir` those two numbers are remembered there
    under a content hash of the tokenizer files, so the next run computes the fingerprint from the
    files alone and loads the tokenizer only when it first encodes or decodes."""

    def __init__(self, directory: Path, memo_dir: Path | None = None, trust_remote_code: bool = False):
        if not directory.is_dir():
            raise UserError(f"tokenizer directory {directory} not found",
                            [Problem("data.tokenizer", f"{directory} is not a directory",
                                     "point it at a local Hugging Face tokenizer directory (`orchestrate tokenizer "
                                     "train` makes one), or remove it to use the built-in byte-level tokenizer")])
        self.directory = directory
        self.trust_remote_code = trust_remote_code
        self._tok = None
        self._memo = memo_dir / f"{self._files_hash()}.json" if memo_dir is not None else None
        remembered = self._remembered()
        if remembered is None:
            self._load()
        else:
            self.eos_id, self.vocab_size = remembered

    def _files(self) -> list[Path]:
        return sorted(p for p in self.directory.iterdir() if p.is_file() and _is_tokenizer_file(p.name))

    def _files_hash(self) -> str:
        h = hashlib.blake2b(b"tokenizer-memo-v1", digest_size=16)
        for path in self._files():
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return h.hexdigest()

    def _remembered(self) -> tuple[int, int] | None:
        try:
            memo = json.loads(self._memo.read_text()) if self._memo is not None else None
            return (int(memo["eos_id"]), int(memo["vocab_size"])) if memo else None
        except (OSError, ValueError, KeyError, TypeError):  # absent or damaged: load and rewrite it
            return None

    def _load(self):
        tok = auto_tokenizer(self.directory, self.trust_remote_code)
        eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
        if eos is None:
            raise UserError(f"the tokenizer in {self.directory} has no end-of-text token",
                            [Problem("data.tokenizer", "neither eos_token nor sep_token is set",
                                     "set eos_token in tokenizer_config.json")])
        # Whole documents are encoded and then packed, so a document longer than the model's context
        # is normal here; without this the tokenizer warns about every one of them.
        tok.model_max_length = 2**62
        self._tok, self.eos_id, self.vocab_size = tok, int(eos), len(tok)
        if self._memo is not None:
            try:  # written whole then renamed: concurrent ranks never read half a file
                self._memo.parent.mkdir(parents=True, exist_ok=True)
                tmp = self._memo.with_name(f".{self._memo.name}.{os.getpid()}")
                tmp.write_text(json.dumps({"eos_id": self.eos_id, "vocab_size": self.vocab_size}))
                os.replace(tmp, self._memo)
            except OSError:  # a read-only cache only costs the next run a tokenizer load
                pass
        return tok

    @property
    def tok(self):
        """The loaded transformers tokenizer (loaded here on first use)."""
        return self._tok if self._tok is not None else self._load()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One call per batch: fast tokenizers encode the batch in Rust, in parallel.
        return self.tok(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def fingerprint(self) -> str:
        """Content hash of the tokenizer's files (not of model weights that may share the directory):
        the same files give the same ids wherever they live."""
        h = hashlib.blake2b(f"{self.vocab_size}/{self.eos_id}".encode(), digest_size=16)
        for path in self._files():
            h.update(path.name.encode() + b"\0")
            h.update(path.read_bytes())
        return f"hf-{h.hexdigest()}"


_TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "spiece", "sentencepiece",
                    "chat_template")


def _is_tokenizer_file(name: str) -> bool:
    """Files AutoTokenizer reads (tokenizer.json, vocab/merges, sentencepiece and tiktoken models)."""
    return name.startswith(_TOKENIZER_FILES) or name.endswith((".model", ".tiktoken"))


def load_tokenizer(tokenizer_dir: Path | None, memo_dir: Path | None = None,
                   trust_remote_code: bool = False) -> Tokenizer:
    """The byte tokenizer for None, else the directory's; `memo_dir`: see `HFTokenizer`."""
    return ByteTokenizer() if tokenizer_dir is None else HFTokenizer(tokenizer_dir, memo_dir, trust_remote_code)


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int | None]:
    """The bos / eos ids (transformers' config names) of a model trained with `tokenizer`: the byte
    tokenizer's end-of-document id as both (GPT-2's convention: one <|endoftext|>); a Hugging Face
    tokenizer's own (its EOS as `HFTokenizer.eos_id` has it)."""
    if isinstance(tokenizer, ByteTokenizer):
        return {"bos_token_id": BYTE_EOS, "eos_token_id": BYTE_EOS}
    return {"bos_token_id": tokenizer.tok.bos_token_id, "eos_token_id": tokenizer.eos_id}


def auto_tokenizer(directory: Path, trust_remote_code: bool):
    """`AutoTokenizer.from_pretrained(directory)` with `trust_remote_code` always given: left unset,
    transformers asks at a TTY whether to run a directory's `auto_map` code, and a "y" there would
    bypass the config's switch. Custom code without the switch is a UserError naming it."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "trust_remote_code" in str(exc):
            raise UserError(f"the tokenizer in {directory} runs its own code", [Problem(
                "data.tokenizer", f"{first} (its auto_map names Python files in the directory)",
                f"use a tokenizer without custom code, or read that code and set {TRUST_SWITCH}: true")]) from None
        raise UserError(f"cannot load the tokenizer in {directory}", [Problem(
            "data.tokenizer", first, "the directory needs tokenizer.json or tokenizer_config.json")]) from None


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint16 below 65,536 ids, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


BYTE_EOS_TOKEN = "<|endoftext|>"
"""The byte tokenizer's end-of-document token as text (GPT-2's name, as `orchestrate tokenizer train`)."""


def byte_tokenizer_fast():
    """`ByteTokenizer` as a `transformers.PreTrainedTokenizerFast` with the same ids.

    GPT-2's byte-level scheme (tokenizers' ByteLevel pre-tokenizer and decoder) maps each byte to one
    printable character; a BPE model whose vocabulary is exactly those 256 characters, at the byte's
    value, and no merges then gives id == byte. `use_regex=False`: no word splitting, which
    would not change the ids but costs time. The end-of-document token is added at id 256;
    `split_special_tokens`: the text "<|endoftext|>" encodes as its 13 bytes, as `ByteTokenizer` does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BYTE_EOS_TOKEN])
    assert tokenizer.token_to_id(BYTE_EOS_TOKEN) == BYTE_EOS  # internal invariant: appended after the bytes
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=BYTE_EOS_TOKEN, bos_token=BYTE_EOS_TOKEN,
                                   unk_token=None, model_max_length=2**62, clean_up_tokenization_spaces=False,
                                   split_special_tokens=True)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (openai/gpt-2 src/encoder.py `bytes_to_unicode`,
    the same table tokenizers' ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def save_tokenizer(tokenizer_dir: Path | None, out_dir: Path, chat_template: str | None = None,
                   trust_remote_code: bool = False) -> None:
    """Write the tokenizer a run used next to its model, loadable with `AutoTokenizer.from_pretrained`:
    a copy of a Hugging Face tokenizer directory, or the byte tokenizer (None) as tokenizer.json; with
    `chat_template` (the YAML's data.chat_template) as its chat template (chat_template.jinja)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer_fast() if tokenizer_dir is None else auto_tokenizer(tokenizer_dir, trust_remote_code)
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(str(out_dir))
