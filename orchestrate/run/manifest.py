"""A checkpoint's completeness manifest: `manifest.json`, written last into the checkpoint directory
(by rank 0 after every rank's files are written, before the rename into place), listing every
other file with its size and checksum. A checkpoint without one was written before manifests
existed ("unverified"); one whose files differ from it is damaged.

Checksum: xxHash's XXH3-128 when the `xxhash` package is there (16 GB/s on one core of the CI
machine, against 1 GB/s for hashlib's sha256: `python bench/manifest_cost.py`), else sha256. It
guards against truncation, partial overwrites and bit rot, not against tampering.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 8 << 20


def _hasher(algorithm: str) -> Any:
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    return hashlib.new(algorithm)


def default_algorithm() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "sha256"
    return "xxh3_128"


def file_digest(path: Path, algorithm: str) -> str:
    h = _hasher(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(ckpt_dir: Path) -> list[Path]:
    return sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.relative_to(ckpt_dir).as_posix() != MANIFEST_FILE)


def write_manifest(ckpt_dir: Path, algorithm: str | None = None) -> dict[str, Any]:
    """Checksum every file of `ckpt_dir` and write the manifest (the directory's last file)."""
    ckpt_dir = Path(ckpt_dir)
    algorithm = algorithm or default_algorithm()
    files = {p.relative_to(ckpt_dir).as_posix(): {"size": p.stat().st_size, "hash": file_digest(p, algorithm)}
             for p in _files(ckpt_dir)}
    manifest = {"format": MANIFEST_FORMAT, "algorithm": algorithm, "files": files,
                "bytes": sum(f["size"] for f in files.values())}
    (ckpt_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def has_manifest(ckpt_dir: Path) -> bool:
    return (Path(ckpt_dir) / MANIFEST_FILE).is_file()


def manifest_problem(ckpt_dir: Path, full: bool = True) -> str | None:
    """Why `ckpt_dir` does not match its manifest (None: it does). `full=False` compares sizes only
    (a stat per file); `full` also recomputes every checksum (reads every byte)."""
    ckpt_dir = Path(ckpt_dir)
    try:
        manifest = json.loads((ckpt_dir / MANIFEST_FILE).read_text())
        files, algorithm = manifest["files"], manifest["algorithm"]
        _hasher(algorithm)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, ImportError) as exc:
        return f"{MANIFEST_FILE} cannot be read ({type(exc).__name__}: {exc})"
    for rel, want in files.items():
        path = ckpt_dir / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{rel} has {size:,} bytes, the manifest says {want['size']:,} (truncated or overwritten)"
    if full:
        for rel, want in files.items():
            if file_digest(ckpt_dir / rel, algorithm) != want["hash"]:
                return f"{rel} does not match its {algorithm} checksum (its contents changed after the write)"
    return None
