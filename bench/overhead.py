"""What orchestrate costs over hand-written training, on the tiny demo model.

1. Throughput: tokens/s of `orchestrate launch` vs a hand-written DeepSpeed script and a hand-written
   FSDP2 script, same model (orchestrate's seeded init_model), data (the demo corpus, byte tokens,
   seq_len blocks), batch, optimizer, schedule and ranks (target ratio >= 0.98).
   tokens/s = tokens of steps WARMUP+1..N-1 / wall time between the ends of step WARMUP and N-1,
   measured the same way for every run (so orchestrate's per-step metrics/all_gather count; the
   last step is left out because orchestrate's final evaluation follows it).
   The hand-written DeepSpeed script runs orchestrate's rendered deepspeed.json (what is measured is
   orchestrate's own overhead); one more row runs it with DeepSpeed's defaults instead, to show what
   the rendered settings cost or gain.
2. Start-up: seconds from starting the command to the end of the first step, `orchestrate launch`
   vs `accelerate launch` of a hand-written Accelerate script with orchestrate's exported
   accelerate.yaml (target ratio <= 0.8). On CPU Accelerate runs every config as DDP, so this
   compares orchestrate's DDP plan.

Every row runs `--repeats` times, interleaved (one round runs every row once, each hand-written row
right after the orchestrate run it copies; bench/repeats.py); tables show median (min-max), and each
ratio is the median (min-max) of the per-round ratios, so load that drifts between rounds cancels.

Usage: .venv/bin/python bench/overhead.py [--steps 40] [--repeats 3] [--gpus 2] [--out DIR] [--json FILE]
       [--only deepspeed|fsdp|ddp ...]  (one comparison's rows only; ddp is the start-up comparison)
       [--short]  (SHORT_STEPS steps, one round: a smoke run, its figures mean nothing;
                   CI runs `--short --only ddp`: tests/unit/bench/test_bench_short_modes.py)
The hand-written scripts live in this file (`_hand_deepspeed`, `_hand_fsdp`, `_hand_accelerate`)
and run under torchrun / accelerate launch as `bench/overhead.py worker <kind> ...`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a plain script from a checkout (`make install` also installs it)
    sys.path.insert(0, str(ROOT))
from bench.repeats import interleave, paired_ratio, spread  # noqa: E402

CONFIG = ROOT / "examples" / "tiny-gpt2.yaml"
WARMUP = 5
SHORT_STEPS = WARMUP + 2
"""The fewest steps `_rates` measures: the warm-up, one timed step and the last (left out)."""

PINS = {
    "deepspeed": ["strategy.backend=deepspeed", "strategy.zero_stage=2"],
    "fsdp": ["strategy.backend=fsdp", "strategy.zero_stage=2"],
    "ddp": ["strategy.backend=ddp", "strategy.zero_stage=0"],
}


# ------------------------------------------------------------------------------------------------
# Hand-written training (runs inside torchrun / accelerate launch; imports nothing from orchestrate)
# ------------------------------------------------------------------------------------------------

def _blocks(corpus: Path, seq_len: int):
    import torch

    stream: list[int] = []
    for doc in corpus.read_text().split("\n\n"):
        if doc.strip():
            stream += list(doc.strip().encode()) + [256]
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len]).view(n, seq_len)


def _schedule(cfg: dict):
    warmup, steps, floor = cfg["warmup"], cfg["max_steps"], cfg["min_lr_ratio"]

    def mult(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup + 1) / max(1, steps - warmup))  # orchestrate/backends/schedule.py
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return mult


def _loop(cfg: dict, step_fn, rank: int, world: int, out: Path) -> None:
    """Run cfg['max_steps'] steps of micro-batches; rank 0 logs the wall time after each."""
    import torch
    import torch.distributed as dist

    blocks = _blocks(Path(cfg["corpus"]), cfg["seq_len"])
    g = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
    log = out.open("w") if rank == 0 else None
    tokens = cfg["micro"] * cfg["accumulation"] * world * cfg["seq_len"]
    for step in range(1, cfg["max_steps"] + 1):
        micro = [blocks[torch.randint(len(blocks), (cfg["micro"],), generator=g)] for _ in range(cfg["accumulation"])]
        loss = step_fn(micro)
        t = torch.tensor([loss])
        dist.all_reduce(t)  # the loss a user would print, as orchestrate does
        if log:
            log.write(json.dumps({"step": step, "loss": float(t) / world, "tokens": tokens, "time": time.time()}) + "\n")
            log.flush()


def _hand_deepspeed(cfg: dict, out: Path) -> None:
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=cfg["betas"], eps=cfg["eps"],
                            weight_decay=cfg["weight_decay"])
    if cfg.get("deepspeed_config"):  # the very JSON orchestrate rendered and ran
        ds = json.loads(Path(cfg["deepspeed_config"]).read_text())
    else:  # DeepSpeed's own defaults for everything but the batch, clipping and the stage
        ds = {"train_micro_batch_size_per_gpu": cfg["micro"], "gradient_accumulation_steps": cfg["accumulation"],
              "train_batch_size": cfg["micro"] * cfg["accumulation"] * world, "gradient_clipping": cfg["clip"],
              "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
    sched = _schedule(cfg)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds,
                                      lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, sched))

    def step(micro):
        total = 0.0
        for ids in micro:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total += float(loss)
        return total / len(micro)

    _loop(cfg, step, rank, world, out)


def _hand_fsdp(cfg: dict, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=cfg["betas"], eps=cfg["eps"],
                            weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(cfg))

    def step(micro):
        total = 0.0
        for i, ids in enumerate(micro):
            model.set_requires_gradient_sync(i == len(micro) - 1)
            loss = model(input_ids=ids, labels=ids).loss / len(micro)
            loss.backward()
            total += float(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return total

    _loop(cfg, step, rank, world, out)


def _hand_accelerate(cfg: dict, out: Path) -> None:
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    acc = Accelerator(gradient_accumulation_steps=cfg["accumulation"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=cfg["betas"], eps=cfg["eps"],
                            weight_decay=cfg["weight_decay"])
    # Not prepared: Accelerate's wrapped scheduler steps once per process per call (split_batches=False).
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(cfg))
    model, opt = acc.prepare(model, opt)

    def step(micro):
        total = 0.0
        for ids in micro:
            with acc.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), cfg["clip"])
                    sched.step()
                opt.step()
                opt.zero_grad()
            total += float(loss)
        return total / len(micro)

    _loop(cfg, step, acc.process_index, acc.num_processes, out)


# ------------------------------------------------------------------------------------------------
# The benchmark driver
# ------------------------------------------------------------------------------------------------

def _orchestrate(run_dir: Path, steps: int, backend: str, gpus: int) -> None:
    """What `orchestrate launch --gpus N tiny-gpt2.yaml --set ...` does, minus click."""
    from orchestrate import api
    from orchestrate.hardware.resolve import resolve_hardware

    # The data cache beside the runs in --out, not under ./runs of the working directory (the default).
    config = api.load_config(CONFIG, [f"train.max_steps={steps}", "train.eval_every=0", *PINS[backend],
                                      f"data.cache_dir={run_dir.parent / 'data_cache'}"])
    result = api.launch(api.launch_request(config, resolve_hardware(gpus=gpus), name="bench", run_dir=run_dir))
    sys.exit(result.exit_code)


def _run_file(run_dir: Path, role: str) -> Path:
    """A file orchestrate wrote into `run_dir`, by its role in plan.json's `files` (RunFiles)."""
    from orchestrate.planner.plan import RunPlan

    files = RunPlan.read(run_dir / "plan.json").files
    name = files.backend[0] if role == "backend_config" else getattr(files, role)
    if name is None:
        sys.exit(f"{run_dir}: orchestrate wrote no {role}")
    return run_dir / name


def _hand_cfg(run_dir: Path, steps: int) -> dict:
    """The hand-written scripts' settings, read from orchestrate's run of the same config."""
    from orchestrate.loading.init_weights import build_initial_model, has_weights
    from orchestrate.planner.plan import RunPlan

    plan = RunPlan.read(run_dir / "plan.json")
    t = plan.config.train
    model = run_dir / "init_model"
    if not has_weights(model):  # DDP builds its from-config model in the workers and writes no weights:
        model = run_dir.with_name(run_dir.name + "-init_model")  # the same seeded weights, untimed
        if not has_weights(model):
            build_initial_model(plan, model)
    return {"model": str(model), "corpus": str(_run_file(run_dir, "demo_corpus")),
            "seq_len": t.seq_len, "micro": plan.strategy.micro_batch_size,
            "accumulation": plan.chosen.gradient_accumulation, "max_steps": steps, "seed": t.seed,
            "lr": t.optimizer.lr, "betas": list(t.optimizer.betas), "eps": t.optimizer.eps,
            "weight_decay": t.optimizer.weight_decay, "clip": t.grad_clip,
            "warmup": t.schedule.warmup_steps, "min_lr_ratio": t.schedule.min_lr_ratio}


def _timed(cmd: list[str], log: Path, env: dict | None = None) -> float:
    """Start time of `cmd` (wall clock), after it finished successfully."""
    start = time.time()
    with log.open("w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **(env or {})})
    if code != 0:
        sys.exit(f"{' '.join(cmd)} failed with exit code {code}; see {log}")
    return start


def _rates(records: list[dict], start: float) -> tuple[float, float]:
    """(tokens/s after warm-up, seconds from command start to the end of step 1)."""
    # The last step is left out: orchestrate evaluates after it (train.eval_every=0 means "at the end").
    steady = records[WARMUP:-1]
    seconds = steady[-1]["time"] - records[WARMUP - 1]["time"]
    return sum(r["tokens"] for r in steady) / seconds, records[0]["time"] - start


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every run (bench/repeats.py)")
    parser.add_argument("--gpus", type=int, default=2, help="ranks (CPU processes without a GPU)")
    parser.add_argument("--out", type=Path, default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write every measurement and ratio here")
    parser.add_argument("--only", choices=sorted(PINS), action="append", default=None,
                        help="run only this backend's comparison (repeatable): deepspeed, fsdp or ddp (start-up)")
    parser.add_argument("--short", action="store_true",
                        help=f"smoke run: {SHORT_STEPS} steps, one round (overrides --steps and --repeats)")
    args = parser.parse_args(argv)
    if args.short:
        args.steps, args.repeats = SHORT_STEPS, 1
    out = (args.out or Path(tempfile.mkdtemp(prefix="orchestrate-bench-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    me, py = str(Path(__file__).resolve()), sys.executable
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.gpus)]
    latest: dict[str, Path] = {}  # backend -> run directory of this round's orchestrate run
    rounds = iter(range(10**9))

    def orchestrate(backend: str):
        def measure() -> tuple[float, float]:
            run_dir = out / f"orchestrate-{backend}-{next(rounds)}"  # a fresh directory: no resume
            start = _timed([py, me, "orchestrate", str(run_dir), str(args.steps), backend, str(args.gpus)],
                           run_dir.with_suffix(".log"))
            latest[backend] = run_dir
            return _rates(_read(run_dir / "metrics.jsonl"), start)
        return measure

    def hand(kind: str, label: str, backend: str, launcher, extra=None, env: dict | None = None):
        """The hand-written script on the model and corpus of this round's orchestrate `backend` run."""
        def measure() -> tuple[float, float]:
            run_dir = latest[backend]
            stem = run_dir.name + "-" + "".join(c if c.isalnum() else "-" for c in label)
            cfg = {**_hand_cfg(run_dir, args.steps), **(extra(run_dir) if extra else {})}
            cfg_path, metrics = out / f"{stem}.json", out / f"{stem}.jsonl"
            cfg_path.write_text(json.dumps(cfg))
            start = _timed([*launcher(run_dir), me, "worker", kind, str(cfg_path), str(metrics)], out / f"{stem}.log", env)
            return _rates(_read(metrics), start)
        return measure

    def accelerate(run_dir: Path) -> list[str]:
        return [py, "-m", "accelerate.commands.launch", "--config_file", str(_run_file(run_dir, "accelerate_config"))]

    # One round runs every row once; each hand-written row follows the orchestrate run it copies.
    # On CPU, Accelerate turns any distributed config into MULTI_CPU DDP (use_cpu), so the start-up
    # comparison is against orchestrate's DDP plan and its exported accelerate.yaml.
    arms = {
        "orchestrate deepspeed": orchestrate("deepspeed"),
        "hand-written deepspeed": hand("deepspeed", "hand-written deepspeed", "deepspeed", lambda _: torchrun,
                                       lambda run_dir: {"deepspeed_config": str(_run_file(run_dir, "backend_config"))}),
        "hand-written deepspeed (DeepSpeed defaults)": hand("deepspeed", "defaults", "deepspeed", lambda _: torchrun),
        "orchestrate fsdp": orchestrate("fsdp"),
        "hand-written fsdp": hand("fsdp", "hand-written fsdp", "fsdp", lambda _: torchrun),
        "orchestrate ddp": orchestrate("ddp"),
        "accelerate launch (ddp)": hand("accelerate", "accelerate", "ddp", accelerate, env={"ACCELERATE_USE_CPU": "true"}),
    }
    only = args.only or sorted(PINS)
    arms = {name: measure for name, measure in arms.items() if any(b in name for b in only)}
    rows = interleave(arms, args.repeats,
                      on_result=lambda r, name, v: print(f"round {r + 1}/{args.repeats} {name}: "
                                                         f"{v[0]:,.0f} tokens/s, {v[1]:.1f} s to step 1", flush=True))
    tps = {name: [v[0] for v in values] for name, values in rows.items()}
    first = {name: [v[1] for v in values] for name, values in rows.items()}

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"orchestrate overhead: tiny GPT-2, {args.gpus} ranks, {args.steps} steps, "
                        f"median (min-max) of {args.repeats} interleaved rounds ({out})")
    for col in ("run", "tokens/s (after warm-up)", "command -> end of step 1 (s)"):
        table.add_column(col, justify="right" if col != "run" else "left")
    for name in rows:
        table.add_row(name, spread(tps[name]).format(",.0f"), spread(first[name]).format(".1f"))
    pairs = [  # paired: each round's ratio of two runs that ran next to each other
        ("throughput vs hand-written DeepSpeed", tps, "orchestrate deepspeed", "hand-written deepspeed", ">= 0.98"),
        ("throughput vs hand-written FSDP2", tps, "orchestrate fsdp", "hand-written fsdp", ">= 0.98"),
        ("start-up vs accelerate launch (ddp)", first, "orchestrate ddp", "accelerate launch (ddp)", "<= 0.8"),
        ("rendered deepspeed.json vs DeepSpeed defaults (hand-written)", tps, "hand-written deepspeed",
         "hand-written deepspeed (DeepSpeed defaults)", "-"),
    ]
    checks = [(name, paired_ratio(values[a], values[b]), target)
              for name, values, a, b, target in pairs if a in values and b in values]
    ratios = Table(title="ratios (median of per-round ratios, min-max)")
    for col in ("comparison", "ratio", "target", "median met"):
        ratios.add_column(col)
    for name, ratio, target in checks:
        met = "-" if target == "-" else ("yes" if (ratio.median >= 0.98 if target.startswith(">=") else ratio.median <= 0.8) else "no")
        ratios.add_row(name, ratio.format(), target, met)
    console = Console()
    console.print(table)
    console.print(ratios)
    if args.json:
        args.json.write_text(json.dumps({"tokens_per_s": tps, "first_step_s": first,
                                         "ratios": {name: r.as_dict() for name, r, _ in checks}}, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "orchestrate":
        _orchestrate(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "worker":
        kind, cfg, out = sys.argv[2], json.loads(Path(sys.argv[3]).read_text()), Path(sys.argv[4])
        {"deepspeed": _hand_deepspeed, "fsdp": _hand_fsdp, "accelerate": _hand_accelerate}[kind](cfg, out)
        # Leave as orchestrate's worker does (orchestrate/worker/__main__.py): a gloo rank torn down at
        # interpreter exit aborts now and then ("terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        sys.exit(main())
