"""What the CPU tensor counter (orchestrate/worker/tensor_peak.py) costs a step of the demo, and what it
measures against the plan's prediction.

The demo's plan (examples/tiny-gpt2.yaml on 2 CPU ranks, as `orchestrate launch --gpus 2` makes it)
trains on 2 real gloo ranks in this process's children (torchrun's elastic_launch); after WARMUP
steps, counted and uncounted steps alternate, so load that drifts over the run hits both alike. The
cost is the median over adjacent pairs of (counted step time / uncounted step time); the peak is the
counter's over start-up and its first COUNTED_STEPS steps, as a run measures it.

Usage: .venv/bin/python bench/tensor_peak.py [--pairs 10] [--short]   (--short: 1 pair, CI)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(ROOT))
from tests.helpers.dist import init_gloo, run_on_ranks  # noqa: E402

CONFIG = ROOT / "examples" / "tiny-gpt2.yaml"
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the demo's CPU workers have it (no DeepSpeed GPU probe line)
WARMUP = 3


def _demo_plan():
    from orchestrate.api import load_config, plan_for
    from orchestrate.hardware.flags import HardwareFlags

    return plan_for(load_config(CONFIG), HardwareFlags(gpus=2).resolve())


def _ranks(model_dir: str, run_dir: str, pairs: int) -> dict:
    import torch

    from orchestrate.backends.rank import Rank
    from orchestrate.backends.registry import get_backend
    from orchestrate.worker.objective import objective_for
    from orchestrate.worker.tensor_peak import COUNTED_STEPS, TensorPeak
    from tests.helpers.engines import builder

    rank, world = init_gloo()
    plan = _demo_plan()
    micro, accumulation = plan.strategy.micro_batch_size, plan.chosen.gradient_accumulation
    seq = plan.config.train.seq_len
    tokens = torch.randint(0, 256, (micro * accumulation, seq), generator=torch.Generator().manual_seed(rank))
    batches = [{"input_ids": x, "labels": x} for x in tokens.split(micro)]
    counter = TensorPeak.start()  # where the worker starts it: before the engine is built
    engine = get_backend(plan.strategy.backend).setup(plan, Rank(rank, rank, world, 0, torch.device("cpu")),
                                                             Path(model_dir), objective_for(plan), builder(plan))
    for _ in range(COUNTED_STEPS):
        engine.train_step(batches)
        counter.step_done()
    for _ in range(WARMUP):
        engine.train_step(batches)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(pairs):
        for counted in (False, True):
            probe = TensorPeak.start() if counted else None
            start = time.perf_counter()
            engine.train_step(batches)
            times[counted].append(time.perf_counter() - start)
            if probe is not None:
                probe.stop()
    return {"peak": counter.peak, "predicted": plan.chosen.memory.gpu_total, "times": times,
            "strategy": plan.strategy.name}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--short", action="store_true", help="one pair of steps (overrides --pairs)")
    args = parser.parse_args(argv)
    if args.short:
        args.pairs = 1
    from orchestrate.loading.init_weights import build_initial_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_initial_model(_demo_plan(), Path(tmp) / "init_model")
        out = run_on_ranks(_ranks, 2, str(model_dir), tmp, args.pairs)
    r = out[0]
    off, on = r["times"][False], r["times"][True]
    ratio = statistics.median(b / a for a, b in zip(off, on, strict=True))
    print(f"demo plan {r['strategy']} on 2 gloo ranks, {args.pairs} pairs of steps after {WARMUP} warm-up steps")
    print(f"  step time uncounted median {statistics.median(off):.3f} s, counted {statistics.median(on):.3f} s: "
          f"counted/uncounted {ratio:.3f} (median of adjacent pairs)")
    print(f"  tensor peak (start-up and the counted steps) rank 0 {r['peak'] / 2**20:.2f} MiB, rank 1 "
          f"{out[1]['peak'] / 2**20:.2f} MiB; predicted {r['predicted'] / 2**20:.2f} MiB per rank")


if __name__ == "__main__":
    main()
