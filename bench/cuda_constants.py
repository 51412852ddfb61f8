"""The CUDA-side memory that orchestrate's plan adds outside the model (orchestrate/planner/
software_terms.py, constants.py): measured on the GPU this runs on, each reading in a fresh process.

For each of four training processes (CUDA modules loaded lazily, torch's default; the caching allocator with its default
segments or `expandable_segments:True`; a plain single-GPU training step or FSDP2 on a one-rank NCCL
group), the device memory used outside the caching allocator (NVML's used bytes minus the allocator's
reserved bytes, from before CUDA is initialised) after each stage:

- `init`: the CUDA context (`torch.zeros(1, device="cuda")`);
- `matmul`: + cuBLAS / cuBLASLt handles and the kernels of a bf16 matrix product;
- `train`: + the kernels of 3 AdamW steps of a GPT-2-small-shaped model (bf16 autocast, SDPA: the
  transformers default);
- `nccl` (FSDP2 processes): + a one-rank NCCL communicator and its all-gather / reduce-scatter.

Two more processes measure NCCL alone (no model): its one-rank communicator formed at the first
collective (torch's default) or at `init_process_group` (with `device_id`, as orchestrate's workers).

The plain and FSDP2 processes also record their allocation history (bench/cuda_trace.py) for
bench/allocator_trace_check.py, which replays it through orchestrate's allocator model.

Usage (on a GPU; nothing else may use it meanwhile, the figures are device-wide):
    python bench/cuda_constants.py --out DIR [--only NAME ...]   # DIR/cuda_constants.json, DIR/micro-*.json.gz
Without a GPU each process fails and its row records why (exit 1): CI runs one that way
(tests/unit/bench/test_bench_short_modes.py); it has no CPU mode, the readings are the GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import cuda_trace  # noqa: E402  (after the path: `python bench/cuda_constants.py` from anywhere)

PROCESSES = {  # name -> (CUDA_MODULE_LOADING, PYTORCH_CUDA_ALLOC_CONF, workload)
    "lazy-segments-plain": ("LAZY", "", "plain"),  # ("EAGER", ...) would add eager loading's context
    "lazy-expandable-plain": ("LAZY", "expandable_segments:True", "plain"),
    "lazy-segments-fsdp2": ("LAZY", "", "fsdp2"),
    "lazy-expandable-fsdp2": ("LAZY", "expandable_segments:True", "fsdp2"),
    # NCCL alone, its one-rank communicator formed at the first collective (torch's default) or at
    # init_process_group (device_id given, as orchestrate's workers do on a GPU).
    "nccl-at-first-collective": ("LAZY", "", "nccl-lazy"),
    "nccl-at-init": ("LAZY", "", "nccl-eager"),
}
GPT2_SMALL = {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}
BATCH, SEQ, STEPS = 4, 1024, 3


def _stage(readings: dict, name: str, used_before: int | None) -> None:
    import torch

    torch.cuda.synchronize()
    used = cuda_trace.device_used_bytes(0)
    reserved = torch.cuda.memory_reserved(0)
    readings[name] = {"used": used, "reserved": reserved,
                      "outside_allocator": None if used is None or used_before is None else used - used_before - reserved}


def _train(model, steps: int, wrap=None) -> list[float]:
    import torch

    if wrap is not None:
        model = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device="cuda").manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, GPT2_SMALL["vocab_size"], (BATCH, SEQ), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def _nccl_only(readings: dict, used_before: int | None, eager: bool) -> dict:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29532")
    dist.init_process_group("nccl", rank=0, world_size=1, **({"device_id": torch.device("cuda", 0)} if eager else {}))
    _stage(readings, "process_group", used_before)
    dist.barrier()
    _stage(readings, "barrier", used_before)
    x = torch.ones(16 * 2**20, device="cuda")  # 64 MiB
    dist.all_reduce(x)
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, x)
    dist.reduce_scatter_tensor(x, out)
    _stage(readings, "collectives", used_before)
    dist.destroy_process_group()
    return {"readings": readings}


def child(name: str, out: Path) -> dict:
    _loading, _conf, workload = PROCESSES[name]
    import torch

    if not torch.cuda.is_available():  # before the slow imports: the row says why at once
        raise SystemExit("no CUDA device: bench/cuda_constants.py measures a GPU")
    from transformers import GPT2Config, GPT2LMHeadModel

    readings: dict = {}
    used_before = cuda_trace.device_used_bytes(0)
    if workload.startswith("nccl"):
        torch.zeros(1, device="cuda")
        _stage(readings, "init", used_before)
        return _nccl_only(readings, used_before, eager=workload == "nccl-eager")
    cuda_trace.start()  # before the first allocation: the replay starts from an empty cache
    torch.zeros(1, device="cuda")
    _stage(readings, "init", used_before)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    del a
    _stage(readings, "matmul", used_before)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**GPT2_SMALL)).cuda()
    wrap = None
    if workload == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        dist.all_reduce(torch.ones(1, device="cuda"))
        _stage(readings, "nccl", used_before)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

        def wrap(m):
            for block in m.transformer.h:
                fully_shard(block, mp_policy=policy)
            return fully_shard(m, mp_policy=policy)

    losses = _train(model, STEPS, wrap)
    _stage(readings, "train", used_before)
    summary = cuda_trace.dump(out / f"micro-{name}.json.gz", 0, used_before, None,
                              {"process": name, "workload": workload, "losses": losses})
    if workload == "fsdp2":
        import torch.distributed as dist

        dist.destroy_process_group()
    return {"readings": readings, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout-s", type=float, default=90, help="each process's limit")
    parser.add_argument("--only", nargs="+", choices=list(PROCESSES), default=list(PROCESSES), metavar="NAME",
                        help=f"run only these processes: {', '.join(PROCESSES)}")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.only:
        loading, conf, _workload = PROCESSES[name]
        env = {**os.environ, "CUDA_MODULE_LOADING": loading, "PYTORCH_CUDA_ALLOC_CONF": conf}
        start = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, __file__, "_child", name, str(args.out)], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=args.timeout_s)
            text = proc.stdout.strip().splitlines()
            row = json.loads(text[-1]) if proc.returncode == 0 and text else {"error": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            row = {"error": f"timed out after {args.timeout_s:.0f} s"}
        row["seconds"] = time.monotonic() - start
        results[name] = row
        stages = row.get("readings", {})
        shown = "  ".join(f"{k} {v['outside_allocator'] / 2**20:,.0f} MiB" for k, v in stages.items()
                          if v.get("outside_allocator") is not None)
        print(f"{name:24s} {row['seconds']:5.1f} s  outside the allocator: {shown or row.get('error', '')[-300:]}",
              flush=True)
    (args.out / "cuda_constants.json").write_text(json.dumps(results, indent=2))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        print(json.dumps(child(sys.argv[2], Path(sys.argv[3]))))
        sys.exit(0)
    sys.exit(main())
