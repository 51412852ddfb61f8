"""What the tiled MLP (`Strategy.mlp_tiles`, orchestrate/loading/tiled_mlp.py) costs a training step on
the CPU, and what it saves: one forward and backward of a Llama-shaped model at equal sequence length,
untiled and with N tiles through DeepSpeed's TiledMLP (ZeRO, FSDP2) and the checkpointed slices (DDP).

Every arm is its own model (same seed: same weights); the arms run interleaved (bench/repeats.py) and
each tiled time is divided by the untiled one of the same round. The tensor peak is one more step per
arm under the CPU tensor counter (orchestrate/worker/tensor_peak.py): the bytes of the tensors a step
makes (activations, gradients), the weights aside.

Usage: .venv/bin/python bench/tiled_mlp_speed.py [--short] [--seq-len 4096] [--tiles 2 4 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(ROOT))
from bench.repeats import interleave, paired_ratio, spread  # noqa: E402

MODEL = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1024}
SHORT = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 257}
IMPLEMENTATIONS = {"deepspeed": True, "checkpoint": False}
"""Arm name -> tile_mlps(repeated_accumulation=...)."""


def _model(shape: dict, seq_len: int, tiles: int, implementation: str):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from orchestrate.loading.tiled_mlp import tile_mlps

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**shape, max_position_embeddings=seq_len),
                                             attn_implementation="sdpa", dtype=torch.float32).train()
    tile_mlps(model, tiles, repeated_accumulation=IMPLEMENTATIONS[implementation])
    return model


def _step(model, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)


def _timed(model, ids):
    def measure() -> float:
        start = time.perf_counter()
        _step(model, ids)
        return time.perf_counter() - start

    return measure


def _peak(model, ids) -> int:
    from orchestrate.worker.tensor_peak import TensorPeak

    counter = TensorPeak.start()
    try:
        _step(model, ids)
    finally:
        counter.stop()
    return counter.peak


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="a tiny model, 1024 tokens, 4 tiles, 2 rounds (CI)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--tiles", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import torch

    shape, seq_len, tile_counts, repeats = MODEL, args.seq_len, args.tiles, args.repeats
    if args.short:
        shape, seq_len, tile_counts, repeats = SHORT, 1024, [4], 2
    ids = torch.randint(0, shape["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(0))
    arms = {"untiled": _model(shape, seq_len, 0, "deepspeed")}
    for tiles in tile_counts:
        for implementation in IMPLEMENTATIONS:
            arms[f"{tiles} tiles, {implementation}"] = _model(shape, seq_len, tiles, implementation)
    for model in arms.values():  # warm-up: first-call allocations and kernel selection
        _step(model, ids)
    times = interleave({name: _timed(model, ids) for name, model in arms.items()}, repeats)
    peaks = {name: _peak(model, ids) for name, model in arms.items()}

    print(f"Llama {shape}, seq_len {seq_len}, batch 1, fp32, {torch.get_num_threads()} threads, {repeats} "
          "interleaved rounds; median (min-max)")
    print(f"{'arm':<24} {'step s':<28} {'vs untiled':<28} {'tensor peak MiB':>15}")
    for name, values in times.items():
        ratio = paired_ratio(values, times["untiled"]).format(".2f") if name != "untiled" else "1"
        print(f"{name:<24} {spread(values).format():<28} {ratio:<28} {peaks[name] / 2**20:>15.1f}")


if __name__ == "__main__":
    main()
