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

An entry is used only when its meta.json names the key it is looked up by (`entry_mismatch`): one
replaced by a copy of another entry would otherwise be a hit and train on the other data; a
mismatch is a miss, rebuilt. An entry or an entry file that is a symbolic link is refused
(`refuse_links`). A full disk while an entry is written is one message naming the cache directory
(`no_space`), the temporary directory removed.
"""

from __future__ import annotations

import errno
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


def refuse_links(entry: Path) -> None:
    """UserError when `entry` or a file in it is a symbolic link: the entry would be read from (and a
    rebuild would replace) whatever it points at. Links are looked at, never followed."""
    links = [entry] if entry.is_symlink() else [p for p in entry.iterdir() if p.is_symlink()] if entry.is_dir() else []
    if links:
        raise UserError(f"the data cache entry {entry} holds a symbolic link", [Problem(
            "data.cache_dir", f"{link} is a symbolic link to {os.readlink(link)}: a cache entry is read only "
            "from files the cache wrote", f"remove it (rm {link}); the entry is rebuilt on the next launch")
            for link in links[:5]])


def entry_mismatch(entry: Path, key: str, sources: list[str]) -> str | None:
    """Why the complete entry at `entry` is not the one of `key` (None: it is). Its meta.json
    records the key it was built for and how many sources it holds; an entry replaced by a copy of
    another one names another key. Source names are not compared: one key is read from several
    copies of the same file (the demo corpus in a run directory and in the cache)."""
    try:
        meta = json.loads((entry / META_FILE).read_text())
    except (OSError, ValueError) as exc:
        return f"its {META_FILE} cannot be read ({exc})"
    if not isinstance(meta, dict) or meta.get("key") != key:
        found = meta.get("key") if isinstance(meta, dict) else None
        return f"its {META_FILE} is the entry of key {found!r}, not {key!r} (copied from another entry)"
    if len(meta.get("sources") or []) != len(sources):
        return f"its {META_FILE} lists {len(meta.get('sources') or [])} source(s), not the {len(sources)} looked up"
    return None


def no_space(exc: BaseException) -> bool:
    """True when `exc`, or an exception it was raised from, is a full disk or quota (libraries such as
    `datasets` wrap the OSError in their own)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full(cache_dir: Path, what: str, input_bytes: int | None) -> UserError:
    """The one message for a full disk while writing into the cache: where, and what was known of the need."""
    try:
        free = f"{shutil.disk_usage(cache_dir).free / 2**20:,.1f} MiB free now"
    except OSError:
        free = "its free space cannot be read"
    need = (f"; the input is {input_bytes / 2**20:,.1f} MiB, and tokenising needs about that much scratch space "
            "plus the entry" if input_bytes is not None else "")
    return UserError("the data cache ran out of space", [Problem(
        "data.cache_dir", f"no space left on device in {cache_dir} while writing {what} ({free}{need}); "
        "the partial entry was removed",
        "free space there, or set data.cache_dir to a disk with room")])


def temp_dir_name(entry: Path) -> Path:
    """A unique sibling of `entry`: several nodes may prepare into one shared cache at once."""
    return entry.with_name(f".tmp-{entry.name}-{socket.gethostname()}-{os.getpid()}")


def temp_dir_for(entry: Path) -> Path:
    """`temp_dir_name(entry)`, created empty."""
    tmp = temp_dir_name(entry)
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
