"""Peak memory of a node while N ranks load a model: transformers' from_pretrained on every rank
against orchestrate's loaders (orchestrate/loading/weights.py).

    .venv/bin/python bench/model_loading.py                 # ~0.95B llama, 2 ranks, ~4 min on 2 cores
    .venv/bin/python bench/model_loading.py --layers 4      # smaller and faster
    .venv/bin/python bench/model_loading.py --short         # 1 layer, 256 wide, orchestrate's loaders only (CI)

A random llama-shaped model is written as sharded safetensors (bf16, as Hub checkpoints are) into a
temporary directory, then each mode runs on 2 gloo ranks while this process samples the ranks'
summed PSS (shared pages, such as the page cache of a memory-mapped file, count once):
- naive: every rank from_pretrained(dtype=float32), the previous DDP / DeepSpeed ZeRO-0/1/2 path;
- fsdp rank0+broadcast: the previous FSDP2 path (rank 0 reads the full state dict, broadcasts);
- fsdp sharded: every rank reads its own rows of each tensor (load_sharded), the FSDP2 path now;
- replicated: meta -> to_empty -> tensor by tensor (load_replicated), the DDP / ZeRO-0/1/2 path now.
  On a CPU-only machine the replicated weights *are* the rank's training memory (N copies by
  design); on GPU nodes they are allocated on the GPU and the CPU holds one tensor at a time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import loading  # noqa: E402
from tests.helpers.dist import run_on_ranks  # noqa: E402
from tests.helpers.memory import NodePeak, write_random_model  # noqa: E402

GiB = 2**30


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--disk-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--modes", default="naive,rank0_broadcast,sharded,replicated")
    parser.add_argument("--short", action="store_true",
                        help="1 layer, 256 wide, modes sharded and replicated (overrides --layers, --hidden, --modes)")
    args = parser.parse_args(argv)
    if args.short:  # each mode starts its ranks afresh; the two kept are orchestrate's, the others references
        args.layers, args.hidden, args.modes = 1, 256, "sharded,replicated"
    arch = {"model_type": "llama", "hidden_size": args.hidden, "intermediate_size": int(args.hidden * 2.75),
            "num_hidden_layers": args.layers, "num_attention_heads": 16, "num_key_value_heads": 16,
            "vocab_size": 32000, "max_position_embeddings": 2048, "tie_word_embeddings": False}
    with tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as tmp:
        start = time.perf_counter()
        params = write_random_model(Path(tmp) / "model", arch, shard_bytes=1 * GiB, dtype=args.disk_dtype)
        print(f"model: llama {params / 1e9:.2f}B parameters, {args.disk_dtype} on disk, fp32 in memory "
              f"({4 * params / GiB:.2f} GiB); written in {time.perf_counter() - start:.0f} s; {args.ranks} ranks")
        print(f"{'mode':<18} {'node peak PSS':>14} {'per-rank VmHWM':>16} {'time':>7}")
        for mode in args.modes.split(","):
            start = time.perf_counter()
            with NodePeak() as node:
                hwm = run_on_ranks(getattr(loading, mode), args.ranks, str(Path(tmp) / "model"))
            print(f"{mode:<18} {node.pss / GiB:>10.2f} GiB {max(hwm.values()) / GiB:>12.2f} GiB "
                  f"{time.perf_counter() - start:>6.0f}s", flush=True)


if __name__ == "__main__":
    main()
