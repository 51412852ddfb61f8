"""Analytical vs simulated per-rank peak memory for a small zoo of models and strategies.

    .venv/bin/python bench/memory_accuracy.py            # zoo + calibration, a few minutes on 2 cores
    .venv/bin/python bench/memory_accuracy.py --no-calibrate

Each row plans the strategy for two generic 8 GB GPUs (launch_configs/profiles/generic-8gb.yaml),
simulates one rank on fake tensors (orchestrate.simulate.verify_plan) and prints:
- analytical: the planner's per-rank estimate (orchestrate.planner.memory.estimate_memory);
- simulated: tensor bytes the simulation saw at the peak (512-byte CUDA blocks), plus what no
  simulation sees, taken from the analytical model's named constants (CUDA context, workspace,
  NCCL buffers, allocator reserve);
- act+logits: the analytical activations + logits terms against the simulated activation peak
  (saved activations, LM head and loss temporaries), the part the model's constants calibrate.
Calibration then simulates 1- and 2-layer versions and prints the coefficients to compare with
orchestrate/planner/constants.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrate.planner import constants as k  # noqa: E402
from orchestrate.planner.strategy import Strategy  # noqa: E402
from orchestrate.simulate.calibrate import calibrate  # noqa: E402
from orchestrate.simulate.spec import plan_from_parts  # noqa: E402
from orchestrate.simulate.verify import VerificationReport, verify_plan  # noqa: E402

GPT2 = {"model_type": "gpt2"}  # 124M, HF defaults (dropout 0.1: accounted CUDA-style)
LLAMA_4L = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 4,
            "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000,
            "max_position_embeddings": 2048, "tie_word_embeddings": False}
WORLD = 2
MiB = 2**20


def _s(backend: str, stage: int, mb: int, ac: bool) -> Strategy:
    return Strategy(backend=backend, zero_stage=stage, offload_optimizer="none", offload_params="none",
                    precision="bf16", activation_checkpointing=ac, micro_batch_size=mb)


ZOO = [
    ("gpt2-124M", GPT2, 1024, _s("fsdp", 3, 1, False)),
    ("gpt2-124M", GPT2, 1024, _s("fsdp", 3, 2, False)),
    ("gpt2-124M", GPT2, 1024, _s("fsdp", 3, 1, True)),
    ("gpt2-124M", GPT2, 1024, _s("fsdp", 2, 1, False)),
    ("gpt2-124M", GPT2, 1024, _s("fsdp", 2, 2, True)),
    ("gpt2-124M", GPT2, 1024, _s("deepspeed", 2, 1, False)),
    ("llama-4L-2048", LLAMA_4L, 1024, _s("fsdp", 3, 1, False)),
    ("llama-4L-2048", LLAMA_4L, 1024, _s("fsdp", 3, 1, True)),
]


def _row(model: str, report: VerificationReport, seconds: float) -> str:
    a, sim = report.analytical, report.simulation
    act_a = (a.get("activations", 0) + a.get("logits", 0)) / MiB
    return (f"{model:<14} {report.strategy:<26} {report.analytical_total / MiB:>9.0f} {report.simulated_bytes / MiB:>9.0f} "
            f"{report.simulated_total / MiB:>9.0f} {report.analytical_over_simulated:>6.2f} "
            f"{act_a:>8.0f} {sim.activation_peak_bytes / MiB:>8.0f} {sim.peak_phase:>9} "
            f"{sim.wall_s:>5.1f}s {sim.max_rss_bytes / 2**30:>4.2f}G {seconds:>5.1f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-calibrate", action="store_true", help="skip the 1-/2-layer calibration runs")
    parser.add_argument("--jobs", type=int, default=2, help="simulations run at once (each is one process)")
    args = parser.parse_args(argv)

    def one(entry):
        model, arch, seq, strategy = entry
        start = time.perf_counter()
        report = verify_plan(plan_from_parts(arch, strategy, seq, WORLD))
        return model, report, time.perf_counter() - start

    start = time.perf_counter()
    print(f"per-rank MiB, {WORLD} x generic 8 GB GPU, seq 1024; ratio = analytical / simulated")
    print(f"{'model':<14} {'strategy':<26} {'analytic':>9} {'sim seen':>9} {'sim+rest':>9} {'ratio':>6} "
          f"{'act+lg A':>8} {'act+lg S':>8} {'peak in':>9} {'sim':>6} {'RSS':>5} {'total':>6}")
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for model, report, seconds in pool.map(one, ZOO):
            print(_row(model, report, seconds), flush=True)

    if not args.no_calibrate:
        print("\ncalibration (1- and 2-layer simulations, fsdp full shard, bf16, mb 1, seq 1024)")
        print(f"constants.py: {k.ACT_BYTES_PER_TOKEN_HIDDEN_16BIT} B per layer per token x hidden, "
              f"{k.LOGITS_BYTES_PER_TOKEN_VOCAB_16BIT} B per token x vocab")
        for model, arch in (("gpt2-124M", GPT2), ("llama-4L-2048", LLAMA_4L)):
            for ac in (False, True):
                c = calibrate(arch, _s("fsdp", 3, 1, ac), 1024, WORLD, parallel=args.jobs)
                print(f"{model:<14} ac={ac!s:<5} per layer {c.per_layer_bytes / MiB:7.1f} MiB = "
                      f"{c.per_layer_coefficient:6.2f} x s*b*h;  fixed {c.fixed_peak_bytes / MiB:7.1f} MiB = "
                      f"{c.logits_coefficient:6.2f} x s*b*V", flush=True)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
