"""The tokenised-data cache: one directory per (sources, tokenizer, text settings) fingerprint.

    <cache_dir>/<name>-<key16>/
      meta.json     what it holds: counts, dtype, EOS id, tokenizer and source fingerprints
      tokens.bin    every document's token ids followed by EOS, back to back (uint16 below 65,536
                    ids, else uint32): the packed stream itself, memory-mapped read-only by every worker
      offsets.bin   int64 start of every document in tokens.bin, plus the total (documents + 1 values)

Sequence length, packing and the validation split are not part of the key: they are views computed
at load time (`blocks.py`), so changing them never tokenises again. An entry appears only complete:
it is written into a temporary directory and renamed into place; a rebuild (`--force`) swaps the
new entry in only once it is complete, so nothing prepared is lost to a failed run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem, UserError

CACHE_FORMAT = 1
"""Bump when the entry layout or the tokenisation changes: old entries are then simply not found."""
DEFAULT_CACHE_SUBDIR = "data_cache"
META_FILE, TOKENS_FILE, OFFSETS_FILE = "meta.json", "tokens.bin", "offsets.bin"


def cache_dir_of(config: RunConfig) -> Path:
    """`data.cache_dir`, or `<train.output_dir>/data_cache`: shared by every run of the config."""
    if config.data.cache_dir:
        return config.resolve_path(config.data.cache_dir)
    return config.output_root() / DEFAULT_CACHE_SUBDIR


def entry_key(identity: dict) -> str:
    blob = json.dumps({"format": CACHE_FORMAT, **identity}, sort_keys=True).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def entry_name(label: str, key: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("._")[:40] or "data"
    return f"{slug}-{key[:16]}"


@dataclass
class TokenStream:
    """An opened cache entry; `tokens` and `offsets` are read-only memory maps."""

    directory: Path
    tokens: np.ndarray
    offsets: np.ndarray
    meta: dict

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1


def _damaged(entry: Path, message: str) -> UserError:
    return UserError(f"the data cache entry {entry} is damaged", [Problem(
        "data.cache_dir", message,
        f"rebuild it with `orchestrate prepare CONFIG --force`, or delete {entry} (it is rebuilt on the next launch)")])


def open_entry(entry: Path) -> TokenStream:
    """Map a complete entry; cheap checks (sizes, counts, bounds) turn damage into a clear error."""
    try:
        meta = json.loads((entry / META_FILE).read_text())
        n_tokens, n_docs, dtype = int(meta["tokens"]), int(meta["documents"]), np.dtype(meta["dtype"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _damaged(entry, f"{entry / META_FILE} cannot be read: {exc}") from None
    if meta.get("format") != CACHE_FORMAT:
        raise _damaged(entry, f"format {meta.get('format')!r}, this version reads {CACHE_FORMAT}")
    for name, expected in ((TOKENS_FILE, n_tokens * dtype.itemsize), (OFFSETS_FILE, (n_docs + 1) * 8)):
        path = entry / name
        size = path.stat().st_size if path.is_file() else None
        if size != expected:
            raise _damaged(entry, f"{path} has {size if size is not None else 'no'} bytes, meta.json says {expected}")
    if n_tokens == 0 or n_docs == 0:
        raise _damaged(entry, "it holds no tokens")
    tokens = np.memmap(entry / TOKENS_FILE, dtype=dtype, mode="r", shape=(n_tokens,))
    offsets = np.memmap(entry / OFFSETS_FILE, dtype=np.int64, mode="r", shape=(n_docs + 1,))
    if offsets[0] != 0 or offsets[-1] != n_tokens:
        raise _damaged(entry, f"{entry / OFFSETS_FILE} does not span the {n_tokens} tokens")
    return TokenStream(entry, tokens, offsets, meta)


def check_ids(stream: TokenStream, vocab_size: int) -> None:
    """Every token id below the tokenizer's `vocab_size`: an entry whose tokens.bin was overwritten
    at its own size passes `open_entry`'s size checks, and an id past the embedding would fail in
    every rank's forward. One pass over the memory map, fast from the page cache
    (docs/measurements.md#datacachepy)."""
    largest = int(stream.tokens.max())
    if largest >= vocab_size:
        raise _damaged(stream.directory, f"{stream.directory / TOKENS_FILE} holds token id {largest:,}, but the "
                       f"tokenizer has {vocab_size:,} ids (the file was changed after it was written)")


def temp_dir_for(entry: Path) -> Path:
    """A unique sibling of `entry`: several nodes may prepare into one shared cache at once."""
    tmp = entry.with_name(f".tmp-{entry.name}-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, entry: Path, replace: bool) -> None:
    """Move the complete `tmp` into place. Without `replace` the first writer wins and a later
    identical one is discarded; with it, the old entry is removed only after the new one is in."""
    if entry.exists() and replace:
        old = entry.with_name(f".old-{entry.name}-{os.getpid()}")
        entry.rename(old)
        tmp.rename(entry)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        tmp.rename(entry)
    except OSError:
        if not (entry / META_FILE).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
