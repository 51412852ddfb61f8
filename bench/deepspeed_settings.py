"""Which of orchestrate's rendered DeepSpeed settings cost speed on this machine, one at a time.

One torchrun (2 gloo ranks by default) builds one DeepSpeed ZeRO-2 engine per variant, all from the
same seeded tiny GPT-2 (examples/tiny-gpt2.yaml's architecture, built from its config: no
download), and then times `--steps` optimizer steps of each variant in turn, A B C ... A B C ...
for `--repeats` rounds (bench/repeats.py). All engines live in the same processes, so start-up,
imports and the machine's load between rounds are shared; tokens/s of each block is measured
between two barriers on rank 0.

Variants: the deepspeed.json orchestrate renders for this plan ("rendered"), DeepSpeed's own
defaults ("defaults": only batch, clipping and the stage set, as bench/overhead.py's hand-written
script does), and "rendered" with exactly one zero_optimization setting changed to DeepSpeed's
default (or flipped where the rendering equals the default).

It then times the per-step work orchestrate's worker adds around a training step
(orchestrate/worker/main.py + metrics.py + signals.py), each call on its own, interleaved too:
the stats all_gather, the stop-signal all_reduce, a metrics line written and flushed vs written
unflushed, and moving a micro-batch to the (CPU) device.

Usage: .venv/bin/python bench/deepspeed_settings.py [--repeats 5] [--steps 10] [--gpus 2] [--json FILE] [--short]
`--short`: "rendered" and "defaults" only, 1 step, 1 round, 10 calls per block (CI).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench.repeats import interleave, paired_ratio, spread  # noqa: E402

CONFIG = ROOT / "examples" / "tiny-gpt2.yaml"
DS_DEFAULT_BUCKET = 500_000_000  # deepspeed/runtime/zero/config.py ZERO_OPTIMIZATION reduce/allgather_bucket_size


def variants(rendered: dict, defaults: dict) -> dict[str, dict]:
    """name -> full DeepSpeed config; each "rendered +" variant changes one zero setting."""
    def one(**change):
        return {**rendered, "zero_optimization": {**rendered["zero_optimization"], **change}}

    return {
        "rendered": rendered,
        "defaults": defaults,
        "rendered + reduce_bucket_size=5e8": one(reduce_bucket_size=DS_DEFAULT_BUCKET),
        "rendered + allgather_bucket_size=5e8": one(allgather_bucket_size=DS_DEFAULT_BUCKET),
        "rendered + both buckets=5e8": one(reduce_bucket_size=DS_DEFAULT_BUCKET, allgather_bucket_size=DS_DEFAULT_BUCKET),
        "rendered + overlap_comm=true": one(overlap_comm=True),
        "rendered + contiguous_gradients=false": one(contiguous_gradients=False),
        "rendered + reduce_scatter=false": one(reduce_scatter=False),
        "rendered + round_robin_gradients=true": one(round_robin_gradients=True),
    }


# ------------------------------------------------------------------------------------------------
# Inside torchrun
# ------------------------------------------------------------------------------------------------

def _worker(spec: dict, out: Path) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, accumulation, seq = spec["micro"], spec["accumulation"], spec["seq_len"]
    config = GPT2Config(**spec["architecture"])
    g = torch.Generator().manual_seed(1000 + rank)
    engines = {}
    for name, ds in spec["variants"].items():
        torch.manual_seed(0)  # every variant starts from the same weights
        model = GPT2LMHeadModel(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engines[name], *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)

    def batch():
        return torch.randint(config.vocab_size - 1, (micro, seq), generator=g)

    def train(engine, steps):
        for _ in range(steps * accumulation):
            ids = batch()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        t = torch.tensor([float(loss)])
        dist.all_reduce(t)

    for engine in engines.values():
        train(engine, 2)  # warm-up: first-step allocations, DeepSpeed's lazy buffers

    def block(engine):
        def measure():
            dist.barrier()
            start = time.perf_counter()
            train(engine, spec["steps"])
            dist.barrier()
            return micro * accumulation * world * seq * spec["steps"] / (time.perf_counter() - start)
        return measure

    results = {"tokens_per_s": interleave({n: block(e) for n, e in engines.items()}, spec["repeats"])}
    results["per_step_work_us"] = _per_step_work(spec, micro, seq, out.parent)
    if rank == 0:
        out.write_text(json.dumps(results))


def _per_step_work(spec: dict, micro: int, seq: int, tmp: Path) -> dict[str, list[float]]:
    """Microseconds per call of what the worker adds to each step (mean over `calls` calls)."""
    import torch
    import torch.distributed as dist

    from orchestrate.worker.metrics import MetricsWriter, gather_step_stats
    from orchestrate.worker.signals import StopRequest

    device = torch.device("cpu")
    stop = StopRequest()
    rank = dist.get_rank()
    flushed = MetricsWriter(tmp / f"flushed-{rank}.jsonl")
    unflushed = (tmp / f"unflushed-{rank}.jsonl").open("w")
    record = {"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "skipped": False, "tokens": 2048,
              "tokens_per_s": 1e4, "step_time_s": 0.1, "time": time.time(), "rss_peak_bytes_max_rank": 1 << 30,
              "node_rss_peak_bytes": 1 << 31, "predicted_gpu_bytes_per_rank": 1 << 30,
              "predicted_cpu_bytes_per_node": 1 << 31}
    b = {"input_ids": torch.zeros(micro, seq, dtype=torch.long), "labels": torch.zeros(micro, seq, dtype=torch.long)}
    calls = spec["calls"]

    def per_call(fn, collective):
        def measure():
            if collective:
                dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - start) / calls * 1e6
        return measure

    return interleave({
        "gather_step_stats (all_gather)": per_call(lambda: gather_step_stats(2.5, 0, device), True),
        "stop.agreed (all_reduce)": per_call(lambda: stop.agreed(device, None), True),
        "metrics line, flushed": per_call(lambda: flushed.write(record), False),
        "metrics line, not flushed": per_call(lambda: unflushed.write(json.dumps(record) + "\n"), False),
        "micro-batch .to(cpu)": per_call(lambda: {k: v.to(device, non_blocking=True) for k, v in b.items()}, False),
    }, spec["repeats"])


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------

SHORT_VARIANTS = ("rendered", "defaults")


def _spec(args) -> dict:
    from orchestrate.api import plan_for
    from orchestrate.backends.deepspeed_render import render_config
    from orchestrate.config.load import load_config
    from orchestrate.hardware.resolve import resolve_hardware

    config = load_config(CONFIG, ["strategy.backend=deepspeed", "strategy.zero_stage=2"])
    plan = plan_for(config, resolve_hardware(gpus=args.gpus))
    rendered = render_config(plan)
    micro, accumulation = plan.strategy.micro_batch_size, plan.chosen.gradient_accumulation
    defaults = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
                "train_batch_size": micro * accumulation * plan.world_size,
                "gradient_clipping": plan.config.train.grad_clip, "zero_optimization": {"stage": 2},
                "steps_per_print": 10**9}
    return {"architecture": config.model.architecture, "seq_len": config.train.seq_len, "micro": micro,
            "accumulation": accumulation, "steps": args.steps, "repeats": args.repeats, "calls": args.calls,
            "variants": {name: ds for name, ds in variants(rendered, defaults).items()
                         if not args.short or name in SHORT_VARIANTS}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per timed block")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed block of per-step work")
    parser.add_argument("--gpus", type=int, default=2, help="ranks (CPU processes without a GPU)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--short", action="store_true",
                        help="two variants, 1 step, 1 round, 10 calls (overrides --steps, --repeats, --calls)")
    args = parser.parse_args(argv)
    if args.short:
        args.steps, args.repeats, args.calls = 1, 1, 10
    work = Path(tempfile.mkdtemp(prefix="orchestrate-ds-settings-"))
    spec = _spec(args)
    (work / "spec.json").write_text(json.dumps(spec))
    out = work / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.gpus),
           str(Path(__file__).resolve()), "worker", str(work / "spec.json"), str(out)]
    with (work / "torchrun.log").open("w") as log:
        if subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT) != 0:
            sys.exit(f"torchrun failed; see {work / 'torchrun.log'}")
    raw = json.loads(out.read_text())
    tps = raw["tokens_per_s"]
    summary = {"tokens_per_s": {n: spread(v).as_dict() for n, v in tps.items()},
               "vs_rendered": {n: paired_ratio(v, tps["rendered"]).as_dict() for n, v in tps.items()},
               "per_step_work_us": {n: spread(v).as_dict() for n, v in raw["per_step_work_us"].items()},
               "raw": raw, "rendered_zero": spec["variants"]["rendered"]["zero_optimization"]}
    print(f"tiny GPT-2, ZeRO-2, {args.gpus} gloo ranks, {args.steps} steps x {args.repeats} interleaved rounds")
    print(f"{'variant':42s} {'tokens/s median (min-max)':>32s} {'vs rendered, paired':>30s}")
    for name, values in tps.items():
        print(f"{name:42s} {spread(values).format(',.0f'):>32s} {paired_ratio(values, tps['rendered']).format():>30s}")
    print(f"\nper-step work, microseconds per call, median (min-max) of {args.repeats} blocks of {args.calls} calls")
    for name, values in raw["per_step_work_us"].items():
        print(f"{name:42s} {spread(values).format(',.1f'):>32s}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        _worker(json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3]))
    else:
        sys.exit(main())
