"""What the checkpoint manifest (orchestrate.run.checkpoints) costs on a GPT-2-124M-sized checkpoint:
fp32 weights plus AdamW's two moments (3 x 124,439,808 x 4 bytes, about 1.49 GB, as torch.save
files like DDP's trainer_state.pt). Times writing the manifest and verifying it (sizes only, and
full checksums), with xxh3_128 and sha256. The files were just written, so they are read from the
page cache: the numbers are the hashing cost, a cold read adds the disk's read time.

    python bench/manifest_cost.py [--dir DIR] [--short]   # --short: 2^20 parameters, 12 MiB (CI)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from orchestrate.run.checkpoints import manifest_problem, write_manifest

GPT2_PARAMETERS = 124_439_808  # orchestrate/model/formulas.py, tied weights counted once
SHORT_PARAMETERS = 2**20


def _verified(problem: str | None) -> None:
    """A manifest just written must verify: a timing of a failed check would mean nothing."""
    if problem is not None:
        raise SystemExit(f"the manifest does not verify: {problem}")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write the 1.5 GB test checkpoint")
    parser.add_argument("--short", action="store_true", help=f"{SHORT_PARAMETERS:,} parameters instead of GPT-2's")
    args = parser.parse_args(argv)
    parameters = SHORT_PARAMETERS if args.short else GPT2_PARAMETERS
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ckpt = Path(tmp)
        for name in ("model", "exp_avg", "exp_avg_sq"):
            torch.save({"t": torch.randn(parameters)}, ckpt / f"{name}.pt")
        total = sum(p.stat().st_size for p in ckpt.iterdir())
        print(f"checkpoint: {total / 1e9:.2f} GB in 3 files")
        for algorithm in ("xxh3_128", "sha256"):
            write_s = _timed(lambda a=algorithm: write_manifest(ckpt, a))
            sizes_s = _timed(lambda: _verified(manifest_problem(ckpt, full=False)))
            full_s = _timed(lambda: _verified(manifest_problem(ckpt, full=True)))
            print(f"{algorithm}: write manifest {write_s:.2f} s ({total / write_s / 1e9:.2f} GB/s), "
                  f"verify sizes {sizes_s * 1e3:.2f} ms, verify checksums {full_s:.2f} s")


if __name__ == "__main__":
    main()
