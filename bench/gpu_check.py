"""The GPU check: gpu-marked tests plus a zoo of offload plans run capped at an 8 GiB card (< 8 min).

On one CUDA GPU:
1. `pytest -m gpu tests/` (the tests that skip on CPU-only machines);
2. for each plan of the zoo (FSDP2 full shard with CPU offload, ZeRO-2 optimizer offload, ZeRO-3
   parameter + optimizer offload, QLoRA under DDP with the chunked loss and under FSDP2 full shard:
   bench/qlora_zoo.py; `--qlora-8b` adds QLoRA of the Llama-3-8B shape), planned for this GPU with
   its memory set to `--gpu-mem` (8 GiB: an RTX 3070-class card; or `--profile rtx3070` for the
   preset's throughputs too), a few real steps through orchestrate's own launch API
   (`orchestrate.api.launch` with `LaunchOptions(worker_module=...)`), each plan in its own process group.
   The workers run `bench/gpu_worker.py`, which caps the CUDA allocator at the planned card's
   memory with `torch.cuda.set_per_process_memory_fraction` and then calls the unchanged worker
   (why there: see its docstring; the plan file is the only channel to the workers);
3. measured `max_memory_allocated` / `max_memory_reserved` (max over ranks and steps, from the run's
   metrics.jsonl: set-up included) and the training steps' own peaks (from the rank's allocation
   history, bench/gpu_worker.py, replayed by bench/cuda_trace.py) against the planned per-rank GPU
   bytes, and tokens/s (median of the steps after the first two) against the speed model's
   estimate; one JSON (`--json`) and a table. Each run's history is kept beside its log.

`--dry-run` (any machine, CPU is enough): imports everything the real run needs, plans every zoo
entry (for `--profile`, default rtx3070, when there is no GPU) and prints the predictions, running
no steps. tests/unit/bench/test_gpu_check.py runs it in CI. `--only NAME ...` runs some entries (a short GPU
session: `--skip-gpu-tests --only qlora-ddp-chunked-loss --qlora-8b`).

A bare GPU machine (PyTorch with CUDA, transformers, accelerate, ...; no network) lacks some
wheels; the JSON's "missing_distributions" lists what this interpreter cannot find. DeepSpeed ships
only as an sdist; build a pure-Python wheel on a machine with the network (its CUDA ops are then
JIT-built on the GPU machine: ninja and nvcc are needed there):

    .venv/bin/pip wheel --no-deps --no-build-isolation deepspeed -c constraints-ci.txt -w wheels/

and carry it with the other missing ones (`pip download --no-deps --only-binary=:all: NAME==VER`:
absent from one such image's package list, not yet confirmed by a run: deepspeed, hjson, pydantic,
pydantic-core, annotated-types, typing-inspection, datasets, fabric, bitsandbytes (the QLoRA entries; its
manylinux wheel bundles its CUDA kernels: take a version built for the image's CUDA) and their own
requirements; peft is in that image); install with
`pip install --no-index --no-deps wheels/*.whl`. Wheels are never committed.

Usage: python bench/gpu_check.py [--dry-run] [--json FILE] [--gpu-mem 8GiB] [--profile NAME]
                                 [--steps 6] [--budget-s 480] [--keep DIR] [--only NAME ...]
                                 [--skip-gpu-tests] [--qlora-8b] [--qlora-8b-timeout-s 540]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import cuda_trace, qlora_zoo  # noqa: E402  (after the path: `python bench/gpu_check.py` from anywhere)

WORKER_MODULE = "bench.gpu_worker"
WARMUP_STEPS = 2  # first steps: CUDA/NCCL initialisation, allocator growth, DeepSpeed's lazy buffers

# A GPT-2 shape of 0.47B parameters with the built-in byte tokenizer (vocab 257, no download): its
# mixed-precision model states (16 B/param, 7.5 GB) do not fit an 8 GiB card, so every entry needs
# its offload, and its checkpoints stay small enough to write within the time budget.
BASE = {
    "model": {"architecture": {"model_type": "gpt2", "n_embd": 1280, "n_layer": 24, "n_head": 20,
                               "n_positions": 1024, "vocab_size": 257, "bos_token_id": 256,
                               "eos_token_id": 256}},
    "train": {"seq_len": 512, "global_batch_size": 8, "eval_every": 0, "eval_batches": 1,
              "schedule": {"warmup_steps": 1}},
    "data": {"generate_demo_corpus": True},
}
ZOO: dict[str, dict] = {  # name -> strategy pins
    "fsdp2-full-shard-cpu-offload": {"backend": "fsdp", "zero_stage": 3, "offload": "cpu", "offload_params": True},
    "zero2-optimizer-offload": {"backend": "deepspeed", "zero_stage": 2, "offload": "cpu", "offload_params": False},
    "zero3-parameter-offload": {"backend": "deepspeed", "zero_stage": 3, "offload": "cpu", "offload_params": True},
    # QLoRA of a 0.89B Llama shape (bench/qlora_zoo.py ENTRIES: its base and train settings): NF4 base
    # quantized as it loads, 8 loss chunks; and the same base sharded by FSDP2 (stored in bf16).
    "qlora-ddp-chunked-loss": {"backend": "ddp"},
    "qlora-fsdp2-full-shard": {"backend": "fsdp", "zero_stage": 3},
}
# What the real run imports (worker, backends, the cap wrapper): --dry-run imports them too.
IMPORTS = ["torch", "transformers", "accelerate", "deepspeed", "peft", "bitsandbytes", "orchestrate.worker.main",
           "orchestrate.backends.deepspeed_backend", "orchestrate.backends.fsdp", "orchestrate.methods.lora.transform",
           "orchestrate.methods.lora.quantized_loading", "bench.gpu_worker", "bench.random_base"]
# Distributions the real run needs: orchestrate's own (pyproject.toml) and DeepSpeed's requirements.
DISTRIBUTIONS = ["torch", "transformers", "accelerate", "datasets", "tokenizers", "safetensors", "pydantic",
                 "pyyaml", "click", "rich", "psutil", "numpy", "fabric", "deepspeed", "hjson", "ninja",
                 "py-cpuinfo", "msgpack", "einops", "nvidia-ml-py", "packaging", "tqdm", "pytest",
                 "peft", "bitsandbytes"]  # QLoRA (orchestrate[lora]); bitsandbytes' wheel bundles its CUDA kernels


def config_for(name: str, steps: int, output_dir: Path) -> dict:
    """Zoo entry `name`'s config; a QLoRA entry's base gets its config.json in output_dir (no weights)."""
    cfg = json.loads(json.dumps(BASE))
    cfg["train"].update(max_steps=steps, output_dir=str(output_dir))
    cfg["strategy"] = dict(ZOO[name])
    return qlora_zoo.apply(cfg, name, output_dir) if name in qlora_zoo.ENTRIES else cfg


def missing_distributions() -> list[str]:
    missing = []
    for name in DISTRIBUTIONS:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


# Cards orchestrate has no preset for, whose real throughputs the speed model should be compared with.
PROFILES_FOR_GPU = {"H200": ROOT / "bench" / "profiles" / "h200.yaml"}


def hardware(args, gpu_name: str | None):
    """The profile to plan for: --profile, else this card's (detected, or bench/profiles/ for cards
    without a preset), else rtx3070 for a dry run without a GPU; its GPU memory set to --gpu-mem.
    The measured/planned tokens/s ratio only means something when the throughputs are the real card's."""
    from orchestrate.hardware.resolve import resolve_hardware

    profile = args.profile
    if profile is None and gpu_name is not None:
        profile = next((str(p) for key, p in PROFILES_FOR_GPU.items() if key in gpu_name), None)
    if profile is None and gpu_name is None:
        profile = "rtx3070"
    return resolve_hardware(profile=profile, gpus=1, gpu_mem=args.gpu_mem)


def plan_entry(config: dict, hw):
    """The plan orchestrate makes for a zoo entry's config (pins honoured): (plan, "") or (None, why not)."""
    from orchestrate.api import is_runnable, plan_for
    from orchestrate.config.load import config_from_dict
    from orchestrate.errors import UserError

    try:
        plan = plan_for(config_from_dict(config, ROOT), hw)
    except UserError as exc:
        return None, str(exc)
    return (plan, "") if is_runnable(plan) else (None, "nothing fits")


def prediction(plan) -> dict:
    """A plan as the JSON row's prediction."""
    mem = plan.chosen.memory
    return {"feasible": True, "strategy": plan.chosen.name, "seq_len": plan.config.train.seq_len,
            "micro_batch": plan.strategy.micro_batch_size,
            "accumulation": plan.chosen.gradient_accumulation, "gpu_bytes": mem.gpu_total,
            # The part the caching allocator serves, i.e. comparable with max_memory_reserved.
            "gpu_allocator_bytes": mem.gpu_allocator,
            "gpu_breakdown": dict(mem.gpu), "cpu_bytes": mem.cpu_total,
            "tokens_per_s": plan.chosen.speed.tokens_per_s, "step_time_s": plan.chosen.speed.step_time_s,
            "gpu_capacity_bytes": plan.hardware.gpu.memory_bytes if plan.hardware.gpu else None}


def predict(config: dict, hw) -> dict:
    """The plan orchestrate makes for a zoo entry's config, as the JSON row's prediction."""
    plan, error = plan_entry(config, hw)
    return prediction(plan) if plan is not None else {"feasible": False, "error": error}


def measured(run_dir: Path) -> dict:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steady = records[WARMUP_STEPS:] or records
    return {"steps": len(records),
            "gpu_max_allocated_bytes": max((r.get("gpu_max_allocated_bytes", 0) for r in records), default=0),
            "gpu_max_reserved_bytes": max((r.get("gpu_max_reserved_bytes", 0) for r in records), default=0),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady) if steady else None,
            "loss_first_last": [records[0]["loss"], records[-1]["loss"]] if records else None}


def run_pytest_gpu(timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/"]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"rc": None, "summary": f"timed out after {timeout_s:.0f} s", "seconds": timeout_s}
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return {"rc": proc.returncode, "summary": lines[-1] if lines else "", "seconds": time.monotonic() - start,
            "tail": "\n".join(lines[-30:])}


def run_plan(config: dict, hw, run_dir: Path, timeout_s: float, stop_when=None) -> dict:
    """One config through `orchestrate.api.launch` in a child process group (killed whole on timeout, or
    once `stop_when()` holds: bench/long_context_gpu.py stops a run whose steps are logged)."""
    hw_file, config_file = run_dir.with_suffix(".hardware.json"), run_dir.with_suffix(".config.json")
    hw_file.write_text(hw.model_dump_json())
    config_file.write_text(json.dumps(config))
    cmd = [sys.executable, str(Path(__file__).resolve()), "_launch", str(config_file), str(hw_file), str(run_dir)]
    log = run_dir.with_suffix(".log")
    start = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        rc = None
        while rc is None and time.monotonic() - start < timeout_s and not (stop_when and stop_when()):
            try:
                rc = proc.wait(timeout=min(2.0, timeout_s))
            except subprocess.TimeoutExpired:
                pass
        if rc is None:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers are in the same group
            proc.wait()
    return {"rc": rc, "seconds": time.monotonic() - start, "log": str(log),
            "log_tail": log.read_text(errors="replace")[-3000:]}


def _launch(config_file: Path, hw_file: Path, run_dir: Path) -> int:
    """In the child: orchestrate's launch API with the workers started as bench.gpu_worker."""
    from orchestrate import api
    from orchestrate.config.load import config_from_dict
    from orchestrate.hardware.profile import HardwareProfile
    from orchestrate.launch.torchrun_args import LaunchOptions
    from orchestrate.transports.local.transport import LocalTorchrun

    # The one bench-only change to the launch: torchrun runs `-m bench.gpu_worker plan.json` instead
    # of `-m orchestrate.worker plan.json` (bench/gpu_worker.py caps the GPU, then calls the worker).
    hw = HardwareProfile.model_validate_json(hw_file.read_text())
    config = config_from_dict(json.loads(config_file.read_text()), ROOT)
    transport = LocalTorchrun(LaunchOptions(worker_module=WORKER_MODULE))
    result = api.launch(api.launch_request(config, hw, name=run_dir.name, run_dir=run_dir), transport)
    if f"-m {WORKER_MODULE} " not in result.command:
        # The launch ignored LaunchOptions.worker_module: the run was not capped.
        print(f"error: the workers did not run {WORKER_MODULE}: {result.command}", file=sys.stderr)
        return 3
    return result.exit_code or 0


def _gib(n) -> str:
    return "-" if not n else f"{n / 2**30:.2f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def print_table(rows: dict, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("plan", "strategy", "seq", "status", "GPU GiB planned (allocator)", "max alloc GiB", "max reserved GiB",
                "reserved/planned", "steps: alloc GiB", "reserved GiB", "reserved/planned",
                "tokens/s planned", "tokens/s", "measured/planned"):
        table.add_column(col, no_wrap=col in ("plan", "strategy"))  # names whole, also in a log file
    for name, row in rows.items():
        p, m = row["prediction"], row.get("measured", {})
        table.add_row(name, p.get("strategy", "-"), str(p.get("seq_len", "-")), row["status"],
                      f"{_gib(p.get('gpu_bytes'))} ({_gib(p.get('gpu_allocator_bytes'))})",
                      _gib(m.get("gpu_max_allocated_bytes")), _gib(m.get("gpu_max_reserved_bytes")),
                      _ratio(m.get("gpu_max_reserved_bytes"), p.get("gpu_allocator_bytes")),
                      _gib(m.get("steps_max_allocated_bytes")), _gib(m.get("steps_max_reserved_bytes")),
                      _ratio(m.get("steps_max_reserved_bytes"), p.get("gpu_allocator_bytes")),
                      f"{p['tokens_per_s']:,.0f}" if p.get("tokens_per_s") else "-",
                      f"{m['tokens_per_s']:,.0f}" if m.get("tokens_per_s") else "-",
                      _ratio(m.get("tokens_per_s"), p.get("tokens_per_s")))
    Console(width=220).print(table)


def entries(args, hw, work: Path) -> tuple[dict[str, dict], list[dict]]:
    """name -> config of the entries to run (the zoo, or --only's; the 8B entry with --qlora-8b) and
    the 8B entry's seq_len search (empty without it)."""
    names = args.only or list(ZOO)
    unknown = [n for n in names if n not in ZOO and n != qlora_zoo.LLAMA3_8B]
    if unknown:
        sys.exit(f"unknown zoo entries {unknown}: choose from {[*ZOO, qlora_zoo.LLAMA3_8B]}")
    configs = {n: config_for(n, args.steps, work) for n in names if n in ZOO}
    search: list[dict] = []
    if args.qlora_8b or qlora_zoo.LLAMA3_8B in names:
        base = json.loads(json.dumps(BASE))
        base["train"].update(output_dir=str(work))
        configs[qlora_zoo.LLAMA3_8B], search = qlora_zoo.llama3_8b_config(base, args.steps, work, hw)
    return configs, search


def run_entry(name: str, config: dict, hw, work: Path, timeout_s: float, keep: bool) -> dict:
    """Write a QLoRA entry's random base (timed), run the plan, read its metrics, delete its run dir."""
    out: dict = {}
    base = config["model"].get("name_or_path")
    if base is not None:
        start = time.monotonic()
        qlora_zoo.write_weights_for(Path(base))
        out["base_write_s"] = time.monotonic() - start
        timeout_s -= out["base_write_s"]
    run_dir = work / name
    out["run"] = run_plan(config, hw, run_dir, timeout_s)
    out["measured"] = measured(run_dir)
    rc = out["run"]["rc"]
    out["status"] = "ok" if rc == 0 else f"failed (rc {rc})"
    if rc != 0 and out["measured"].get("steps") == config["train"]["max_steps"]:
        # Every step's peaks are in metrics.jsonl; what failed came after (the merged save, for 8B a 32 GB write).
        out["status"] = f"trained, then failed (rc {rc})"
    # The ranks' allocation histories (bench/gpu_worker.py) outlive the run directory, beside its log.
    out["cuda_traces"] = []
    for trace in sorted(run_dir.glob("cuda-trace-rank*.json.gz")):
        kept = work / f"{name}.{trace.name}"
        shutil.copyfile(trace, kept)
        out["cuda_traces"].append(str(kept))
    if out["cuda_traces"]:  # the training steps' own peaks, apart from set-up and the final save
        phases = cuda_trace.replay_trace(cuda_trace.read(Path(out["cuda_traces"][0])))["phase_peaks"]
        if phases:
            out["measured"].update(steps_max_allocated_bytes=phases["steps"]["allocated"],
                                   steps_max_reserved_bytes=phases["steps"]["reserved"])
    if not keep:
        subprocess.run(["rm", "-rf", str(run_dir)], check=False)  # checkpoints and merged models: GBs each
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="import and plan only; no GPU needed")
    parser.add_argument("--json", type=Path, default=None, help="write the results here (default: in the work dir)")
    parser.add_argument("--gpu-mem", default="8GiB", help="the planned card's memory, the cap of the real one")
    parser.add_argument("--profile", default=None, help="plan for this hardware preset instead of the detected GPU")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--budget-s", type=float, default=480, help="the zoo's time budget (without --qlora-8b)")
    parser.add_argument("--keep", type=Path, default=None, help="keep run directories here (default: deleted)")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only these zoo entries")
    parser.add_argument("--qlora-8b", action="store_true",
                        help=f"also {qlora_zoo.LLAMA3_8B}: QLoRA of the Llama-3-8B shape (minutes, 48 GB of disk)")
    parser.add_argument("--skip-gpu-tests", action="store_true", help="run the zoo only (a short GPU session)")
    parser.add_argument("--qlora-8b-timeout-s", type=float, default=540, help="the 8B entry's own time limit")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    for module in IMPORTS:
        importlib.import_module(module)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        sys.exit("no CUDA GPU here: run with --dry-run, or on a GPU machine")
    work = (args.keep or Path(tempfile.mkdtemp(prefix="orchestrate-gpu-check-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if cuda else None
    hw = hardware(args, device)
    configs, search_8b = entries(args, hw, work)
    result = {"dry_run": args.dry_run, "cuda": cuda, "steps": args.steps, "device": device,
              "torch": torch.__version__, "missing_distributions": missing_distributions(),
              "hardware": json.loads(hw.model_dump_json()), "plans": {}}
    if search_8b:
        result["qlora_8b_seq_search"] = {"gpu_memory_headroom": qlora_zoo.HEADROOM_8B, "tried": search_8b}
    if args.dry_run or args.skip_gpu_tests:
        result["gpu_tests"] = {"summary": f"not run ({'dry run' if args.dry_run else '--skip-gpu-tests'})"}
    else:
        result["gpu_tests"] = run_pytest_gpu(min(150.0, deadline - time.monotonic() - 60))
    if not args.dry_run and any(c["strategy"].get("backend") == "deepspeed" for c in configs.values()):
        # DeepSpeed JIT-compiles CPU Adam (the offload plans' optimizer) on first use, about a minute
        # on a fresh machine: here, once, rather than inside the first plan's steps and timeout.
        from orchestrate.backends import prebuild

        start = time.monotonic()
        prebuild.main()
        result["prebuild_s"] = time.monotonic() - start
    zoo = [n for n in configs if n != qlora_zoo.LLAMA3_8B]
    for name, config in configs.items():
        row = {"prediction": predict(config, hw), "status": "planned"}
        if not row["prediction"]["feasible"]:
            row["status"] = "infeasible"
        elif not args.dry_run:
            if name == qlora_zoo.LLAMA3_8B:  # its own limit, outside the zoo's budget
                row.update(run_entry(name, config, hw, work, args.qlora_8b_timeout_s, args.keep is not None))
            elif (left := deadline - time.monotonic()) < 45:
                row["status"] = "skipped: out of time budget"
            else:
                timeout = left / (len(zoo) - zoo.index(name))  # an equal share of what is left
                row.update(run_entry(name, config, hw, work, timeout, args.keep is not None))
        result["plans"][name] = row
    if args.keep is None:
        for base in work.glob("base-*"):
            subprocess.run(["rm", "-rf", str(base)], check=False)  # the 8B base is 16 GB
    out = args.json or work / "gpu_check.json"
    out.write_text(json.dumps(result, indent=2))
    print_table(result["plans"], f"GPU check ({'dry run: predictions only' if args.dry_run else result['device']}, "
                                 f"capped at {args.gpu_mem}, {args.steps} steps)")
    print(f"gpu tests: {result['gpu_tests']['summary']}")
    print(f"missing distributions: {', '.join(result['missing_distributions']) or 'none'}")
    print(f"results: {out}")
    failed = [n for n, r in result["plans"].items() if r["status"] not in ("ok", "planned")]
    return 1 if failed or (result["gpu_tests"].get("rc") not in (None, 0, 5)) else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_launch":
        sys.exit(_launch(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])))
    sys.exit(main())
