"""Checkpoint write/load time and size: orchestrate's checkpoints vs a plain torch.save of the same state.

For each model and backend, N gloo ranks on the CPU build the engine orchestrate's worker builds,
take one optimizer step (so the Adam states exist), then
  - orchestrate: `Checkpointer.save` (engine checkpoint + RNG/sampler state + meta, temporary
    directory, barrier, rename, `latest`) and `Checkpointer.load` into the live engine;
  - torch.save: every rank saves the very state the engine holds (FSDP2: its model and optimizer
    shards; DeepSpeed: the module on rank 0 and each rank's ZeRO optimizer partition; DDP: model and
    optimizer on rank 0) to one file per rank, then loads it back with torch.load(weights_only=True).
Times are the slowest rank's, between barriers; sizes are the bytes on disk. Each write runs
`--repeats` times interleaved with torch.save (then each load with torch.load; bench/repeats.py),
printed as median (min-max) with the per-round ratio orchestrate / torch.save.

Models: "tiny" is examples/tiny-gpt2.yaml's architecture (the demo); "gpt2-124m" is GPT-2 small's
shape (768 wide, 12 layers, 50257 vocab), randomly initialised.

Usage: .venv/bin/python bench/checkpoint.py [--models tiny,gpt2-124m] [--backends fsdp,deepspeed,ddp]
                                            [--ranks 2] [--repeats 3] [--out bench-checkpoint.json] [--short]
`--short`: the tiny model only, one round (CI runs `--short --backends fsdp`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(ROOT))
from bench.repeats import interleave, paired_ratio, spread  # noqa: E402

MODELS = {
    "tiny": None,  # read from examples/tiny-gpt2.yaml
    "gpt2-124m": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
                  "vocab_size": 50257, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
}
STRATEGY = {"fsdp": ("fsdp", 3), "deepspeed": ("deepspeed", 2), "ddp": ("ddp", 0)}


def _architecture(model: str) -> dict:
    if MODELS[model] is not None:
        return MODELS[model]
    import yaml

    return yaml.safe_load((ROOT / "examples" / "tiny-gpt2.yaml").read_text())["model"]["architecture"]


def _plan(model: str, backend: str, ranks: int):
    from orchestrate.config.load import config_from_dict
    from orchestrate.hardware.profile import HardwareProfile
    from orchestrate.model.meta import load_model_config, shape_from_config
    from orchestrate.planner.estimate import MemoryEstimate, SpeedEstimate
    from orchestrate.planner.plan import Candidate, RunPlan
    from orchestrate.planner.strategy import Strategy

    name, stage = STRATEGY[backend]
    strategy = Strategy(name, stage, "none", "none", "fp32", False, 1)
    cfg = config_from_dict({"model": {"architecture": _architecture(model)},
                            "train": {"seq_len": 128, "global_batch_size": ranks, "micro_batch_size": 1,
                                      "precision": "fp32", "max_steps": 10}}, None)
    hardware = HardwareProfile(name="cpu-bench", gpus_per_node=0, cpu_processes=ranks,
                               cpu_memory_bytes=16 * 2**30, cpu_cores=2)
    cand = Candidate(strategy, MemoryEstimate({}, {}), SpeedEstimate(0.0, 0.0), 1, fits=True)
    return RunPlan(config=cfg, hardware=hardware, shape=shape_from_config(load_model_config(cfg)),
                candidates=[cand], chosen=cand)


def _plain_state(engine, backend: str, rank: int) -> dict:
    """What this rank holds, as a torch.save-able dict of local tensors."""
    if backend == "fsdp":
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.tensor import DTensor

        def local(value):
            if isinstance(value, DTensor):
                return value.to_local()
            if isinstance(value, dict):
                return {k: local(v) for k, v in value.items()}
            return value

        model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
        return {"model": local(model_sd), "optim": local(optim_sd)}
    if backend == "deepspeed":
        ds = engine.engine
        return {"model": ds.module.state_dict() if rank == 0 else {}, "optim": ds.optimizer.state_dict()}
    return {"model": engine.model.module.state_dict(), "optim": engine.optimizer.state_dict()} if rank == 0 else {}


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _rank_main(model: str, backend: str, ranks: int, work: str, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    from orchestrate.backends.rank import Rank
    from orchestrate.backends.registry import get_backend
    from orchestrate.backends.safe_load import deepspeed_checkpoint_classes, weights_only_loads
    from orchestrate.loading.init_weights import build_initial_model
    from orchestrate.run.checkpoints import latest_checkpoint
    from orchestrate.worker.checkpointing import Checkpointer
    from orchestrate.worker.objective import CausalLMObjective
    from tests.helpers.engines import builder

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(max(1, 2 // ranks))
    work_dir = Path(work)
    plan = _plan(model, backend, ranks)
    if rank == 0:
        build_initial_model(plan, work_dir / "init_model")
    dist.barrier()
    me = Rank(rank, rank, ranks, 0, torch.device("cpu"))
    engine = get_backend(backend).setup(plan, me, work_dir / "init_model", CausalLMObjective(), builder(plan))
    ids = torch.randint(0, plan.shape.vocab_size, (1, 128), generator=torch.Generator().manual_seed(rank))
    engine.train_step([{"input_ids": ids, "labels": ids}])
    checkpointer = Checkpointer(plan, engine, me, work_dir / "run", work_dir / "init_model")
    sampler = {"epoch": 0, "position": 0, "seed": 0, "num_blocks": 1}
    out = {"params": plan.shape.parameters}
    plain_dir = work_dir / "torch_save"
    plain_dir.mkdir(exist_ok=True)
    target = plain_dir / f"rank{rank}.pt"
    state = _plain_state(engine, backend, rank)
    allowed = deepspeed_checkpoint_classes() if backend == "deepspeed" else []
    steps = iter(range(1, 10**9))  # a new step per save: keep_checkpoints rotates the old ones

    def load() -> None:
        with weights_only_loads(allowed):
            torch.load(target, map_location="cpu")

    # Interleaved (bench/repeats.py): write, torch.save, write, torch.save, ...; then the loads.
    out.update(interleave({"ckpt_write_s": lambda: _timed(lambda: checkpointer.save(next(steps), sampler)),
                           "torch_save_s": lambda: _timed(lambda: torch.save(state, target))}, repeats))
    out.update(interleave({"ckpt_load_s": lambda: _timed(lambda: checkpointer.load(latest_checkpoint(checkpointer.run_dir))),
                           "torch_load_s": lambda: _timed(load)}, repeats))
    if rank == 0:
        out["ckpt_bytes"] = _size(latest_checkpoint(checkpointer.run_dir))
        out["torch_save_bytes"] = _size(plain_dir)
    dist.destroy_process_group()
    return out


def measure(model: str, backend: str, ranks: int, scratch: Path, repeats: int) -> dict:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from orchestrate.ports import free_port

    work = scratch / f"{model}-{backend}-{ranks}"
    work.mkdir(parents=True)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
                          monitor_interval=0.2, start_method="spawn")
    results = elastic_launch(config, _rank_main)(model, backend, ranks, str(work), repeats)
    row = {"model": model, "backend": backend, "ranks": ranks, "params": results[0]["params"],
           "ckpt_bytes": results[0]["ckpt_bytes"], "torch_save_bytes": results[0]["torch_save_bytes"]}
    for key in ("ckpt_write_s", "ckpt_load_s", "torch_save_s", "torch_load_s"):  # the slowest rank, per round
        row[key] = [max(r[key][i] for r in results.values()) for i in range(repeats)]
    shutil.rmtree(work, ignore_errors=True)
    return row


def _table(rows: list[dict]) -> str:
    """Times as median (min-max) over rounds; ratios are orchestrate / torch.save of each round's pair."""
    lines = ["| model | params | backend | ranks | checkpoint write s | load s | size MB | "
             "torch.save s | torch.load s | size MB | write ratio | load ratio |", "|" + "---|" * 12]
    for r in rows:
        t = {k: spread(r[k]).format(".2f") for k in ("ckpt_write_s", "ckpt_load_s", "torch_save_s", "torch_load_s")}
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['backend']} | {r['ranks']} | "
                     f"{t['ckpt_write_s']} | {t['ckpt_load_s']} | {r['ckpt_bytes'] / 1e6:.1f} | "
                     f"{t['torch_save_s']} | {t['torch_load_s']} | {r['torch_save_bytes'] / 1e6:.1f} | "
                     f"{paired_ratio(r['ckpt_write_s'], r['torch_save_s']).format('.2f')} | "
                     f"{paired_ratio(r['ckpt_load_s'], r['torch_load_s']).format('.2f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,gpt2-124m")
    parser.add_argument("--backends", default="fsdp,deepspeed,ddp")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (bench/repeats.py)")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--scratch", type=Path, help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--short", action="store_true", help="the tiny model, one round (overrides --models, --repeats)")
    args = parser.parse_args(argv)
    if args.short:
        args.models, args.repeats = "tiny", 1
    scratch = Path(tempfile.mkdtemp(prefix="orchestrate-bench-ckpt-", dir=args.scratch))
    rows = []
    try:
        for model in args.models.split(","):
            for backend in args.backends.split(","):
                rows.append(measure(model, backend, args.ranks, scratch, args.repeats))
                print(_table(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(_table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
