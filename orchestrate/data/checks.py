"""Data-side input checks that need the machine or the prepared data: the cache directory is a
writable directory, `num_proc` fits the CPU cores, the corpus gives at least one training sample,
`--vocab-size` is within what a corpus and the tokenizers library can give."""

from __future__ import annotations

import os
from pathlib import Path

from orchestrate.data.sources import Source, total_bytes
from orchestrate.errors import Problem, UserError

MAX_VOCAB = 2**21
"""Largest `--vocab-size`: 8x the largest released vocabularies (Gemma's 262,144 ids). Above it
`tokenizers`' BPE trainer allocates per id up front and aborts in Rust (exit 134) for 10**12."""
_UNCOMPRESSED = (".txt", ".text", ".json", ".jsonl", ".csv", ".tsv")


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask under Slurm/taskset, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_num_proc(num_proc: int) -> int:
    """`data.num_proc` as given, refused above the cores: each is a Python process with its own
    copy of the tokenizer; 100,000 of them exhaust the machine long before finishing."""
    cores = cpu_cores()
    if num_proc > cores:
        raise UserError("too many tokeniser processes", [Problem(
            "data.num_proc", f"{num_proc} processes but this machine gives this process {cores} CPU core(s)",
            f"use data.num_proc <= {cores}, or auto")])
    return num_proc


def ensure_cache_dir(path: Path) -> Path:
    """Create `data.cache_dir` if needed; a file in its place or no write permission is a UserError."""
    fix = "set data.cache_dir to a directory you can write to"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError("the data cache directory is not usable", [Problem(
            "data.cache_dir", f"{path} is a file, not a directory", fix)]) from None
    except OSError as exc:  # NotADirectoryError (a parent is a file), PermissionError, read-only file system
        raise UserError("the data cache directory is not usable", [Problem(
            "data.cache_dir", f"cannot create {path}: {exc.strerror}", fix)]) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError("the data cache directory is not usable", [Problem(
            "data.cache_dir", f"{path} is not writable by this user", fix)])
    return path


def too_long(kept: int, dropped: int, seq_len: int, policy: str) -> tuple[str, str]:
    """(message, fix) when the samples `data.truncation` dropped for their length (`dropped`, beside
    the `kept` ones) leave too few: that, and what to set, rather than "add data"."""
    which = f"all {dropped:,} samples are" if kept == 0 else f"{dropped:,} of the {kept + dropped:,} samples are"
    if policy == "drop":
        return (f"{which} longer than train.seq_len {seq_len}, and data.truncation: drop leaves each out",
                "raise train.seq_len, or set data.truncation: keep_answer (each prompt cut from the left so that "
                "its answers fit)")
    if policy == "keep_answer":
        return (f"{which} longer than train.seq_len {seq_len} with their prompt cut away: their last answer alone "
                "does not fit", "raise train.seq_len, or shorten the answers (data.truncation: keep_start trains "
                f"each sample's first {seq_len} tokens, cutting its answer)")
    return (f"{which} longer than train.seq_len {seq_len}, and cut to their first {seq_len} tokens they have no "
            "token left to train on (the prompt fills them)", "raise train.seq_len so that the answers start within "
            "it, or shorten the prompts")


def require_training_samples(count: int, tokens: int, seq_len: int, packing: bool, where: str,
                             dropped: tuple[int, int, str] | None = None) -> None:
    """`orchestrate prepare` must not succeed with data no run can train on. `dropped`: (samples
    kept, samples dropped for their length, data.truncation) of chat / instruction / preference data."""
    if count > 0:
        return
    if dropped is not None and dropped[1] > 0:
        raise UserError("no sample fits train.seq_len", [Problem(where, *too_long(*dropped[:2], seq_len, dropped[2]))])
    if packing:
        message = f"the corpus has {tokens:,} tokens, shorter than one block of train.seq_len {seq_len}"
        fix = f"add data, or lower train.seq_len to {tokens} or less" if tokens else "add data"
    else:
        message, fix = "the corpus has no training documents", "add data"
    raise UserError("not enough training data", [Problem(where, message, fix)])


def check_vocab_size(vocab_size: int, sources: list[Source], min_vocab: int) -> None:
    """Refuse a `--vocab-size` no corpus could fill before the trainer allocates for it. BPE adds at
    most one id per merge, and a merge needs a pair of adjacent tokens, so an uncompressed corpus of
    n bytes gives fewer than n merges (Sennrich et al. 2016, https://arxiv.org/abs/1508.07909)."""
    if vocab_size > MAX_VOCAB:
        raise UserError("vocabulary too large", [Problem(
            "--vocab-size", f"{vocab_size:,} ids; the largest released vocabularies have about 262,144",
            f"use at most {MAX_VOCAB:,} (typical: 8,000 to 64,000)")])
    plain = all(s.kind == "files" and all(str(f).endswith(_UNCOMPRESSED) for f in s.files) for s in sources)
    size = total_bytes(sources) if plain else None
    if size is not None and vocab_size > min_vocab + size:
        raise UserError("vocabulary too large for the corpus", [Problem(
            "--vocab-size", f"{vocab_size:,} ids, but {size:,} bytes of text give fewer than {min_vocab + size:,}",
            f"use at most {min_vocab + size:,}, or train on more text")])
