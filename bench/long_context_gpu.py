"""Long context on one GPU capped at 8 GiB: Llama-3.1-8B's shape with random NF4 weights, LoRA r=32 on all
seven linears of each block, batch 1, under orchestrate, TRL SFTTrainer + peft, and Unsloth; the longest
sequence each trains, its tokens/s and peak memory, one table and one JSON (< 10 min on an H100/H200).

1. The base: examples/llama3-8b.yaml's architecture with Llama-3.1's 131072 positions (the same tensors;
   only the positions bound differs), random bf16 weights drawn on the GPU and written tensor by tensor
   (bench/random_base.py) into --work (default /dev/shm: 16 GB in RAM, read back fast); each method
   quantizes it to NF4 (double quant, bf16 compute) as it loads, as orchestrate's QLoRA does.
2. orchestrate: the longest train.seq_len the planner says fits a 1 x 8 GiB profile (bisection over
   `orchestrate.planning.plan_for`, as bench/longest_seq_len.py's 1 x 8 GiB row), then `--steps` real steps of that plan through
   orchestrate's launch with bench/gpu_worker.py capping the card at the plan's 8 GiB; measured
   max_memory_allocated / max_memory_reserved (metrics.jsonl) against the plan's tensors and allocator bytes,
   and tokens/s. The run is stopped once its steps are logged: the merged fp32 save after them (a 32 GB write)
   is not what is measured.
3. TRL SFTTrainer + peft, and Unsloth (FastLanguageModel, its gradient checkpointing) when it imports, each in
   its own process capped at 8 GiB with `torch.cuda.set_per_process_memory_fraction`: the model loaded once,
   then `--steps` steps per length tried, bisecting over lengths (multiples of 256 up to --max-seq) with
   torch.OutOfMemoryError caught, until the deadline (then the row says its longest is a lower bound). The
   optimizer is the one orchestrate's plan chose (adamw8bit -> TRL's adamw_8bit), gradient checkpointing on.

`--dry-run` (any machine; CI: tests/unit/bench/test_long_context_gpu.py): plans orchestrate's longest sequence, and where
TRL imports runs its trainer for a few steps on a tiny Llama on the CPU (the same code path, no memory search);
everything needing CUDA is skipped with the reason in the table and the JSON.

Prepared device command (the session's checkout must hold this file: merge branch `liger` first). Here,
from the repository root, once: `PEERS=1 bash ../shared/gpu/fetch-wheels.sh .whl` (the wheels the image
lacks plus TRL 1.16 and Liger 0.8.5 in .whl/peers, ~51 MB; /.whl/ is in .git/info/exclude). Then `run` with
carry [".whl"], timeout_s 600 (DeepSpeed's CPU Adam, which the planned ZeRO-3 offload plan needs, JIT-builds
in the background meanwhile; the fused-kernel GPU tests, tests/unit/model/test_fused_kernels.py, run first, 60 s at most):

    python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl .whl/peers/*.whl \
      && export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
      && (python3 -m orchestrate.backends.prebuild > $OUT/prebuild.log 2>&1 &) \
      && (timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/model/test_fused_kernels.py 2>&1 | tail -8) \
      ; python3 bench/long_context_gpu.py --out $OUT --budget-s 480

Unsloth is skipped there (printed reason: not importable): its wheels (`UNSLOTH=1`, 31.5 MB) and their own
needs (xformers, torchao, cut_cross_entropy, tyro, msgspec, ...; unsloth 2026.10.9 wants trl<=1.15 and
datasets<5) do not fit one call's 64 MiB beside bitsandbytes' 43 MB wheel: a session of its own.

Usage: python bench/long_context_gpu.py [--dry-run] [--out DIR] [--work DIR] [--gpu-mem 8GiB] [--cpu-mem 64GiB]
                                        [--steps 3] [--max-seq 16384] [--budget-s 540]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import gpu_check, qlora_zoo  # noqa: E402  (after the path: `python bench/long_context_gpu.py`)

LORA_R, LORA_ALPHA = 32, 64
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEER_STEP = 256  # the peers' lengths: multiples of this (bisection over at most --max-seq / 256 lengths)
TRL_OPTIM = {"adamw": "adamw_torch", "adamw8bit": "adamw_8bit"}  # orchestrate's optimizer -> TRL's optim
VOCAB_USED = 257  # token ids drawn below the byte tokenizer's vocabulary (orchestrate's demo corpus too)
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": VOCAB_USED,
              "max_position_embeddings": 512, "bos_token_id": 256, "eos_token_id": 256}


def longest(fits, high: int, step: int, deadline: float | None = None) -> int:
    """The largest multiple of `step` up to `high` for which `fits` holds (0: not even `step`), by bisection:
    `fits` must hold below some length and fail above it. Past `deadline` (time.monotonic()) no further length
    is tried and the longest that fitted so far is returned (a bound, not the limit)."""
    low, high = 0, high // step
    while low < high and (deadline is None or time.monotonic() < deadline):
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(step * middle) else (low, middle - 1)
    return step * low


def architecture() -> dict:
    arch = dict(qlora_zoo.architecture("llama3-8b"))
    arch["max_position_embeddings"] = 131072  # Llama-3.1's; the example's 8192 would bound the search
    return arch


def orchestrate_config(base: Path, seq_len: int, steps: int, work: Path) -> dict:
    cfg = json.loads(json.dumps(gpu_check.BASE))
    cfg["model"] = {"name_or_path": str(base)}
    cfg["train"].update(seq_len=seq_len, global_batch_size=1, micro_batch_size=1, max_steps=steps, method="qlora",
                        lora={"r": LORA_R, "alpha": LORA_ALPHA, "target_modules": SEVEN},
                        optimizer={"name": "auto"}, output_dir=str(work))
    return cfg


def planned_longest(base: Path, hw, steps: int, work: Path, max_seq: int) -> tuple[int, object | None]:
    """orchestrate's longest seq_len (a multiple of 64) on `hw` and its plan (None when not even 64 fits)."""
    from orchestrate.api import is_runnable
    from orchestrate.config.load import config_from_dict
    from orchestrate.planning import plan_for

    def plan(n: int):
        made = plan_for(config_from_dict(orchestrate_config(base, n, steps, work), ROOT), hw)
        return made if is_runnable(made) else None

    length = longest(lambda n: plan(n) is not None, max_seq, 64)
    return length, (plan(length) if length else None)


def run_orchestrate(plan, hw, work: Path, steps: int, timeout_s: float) -> dict:
    """The plan's steps through orchestrate's launch (capped workers), stopped once they are logged."""
    run_dir = work / "orchestrate-run"
    metrics = run_dir / "metrics.jsonl"

    def logged() -> bool:
        return metrics.is_file() and len(metrics.read_text().splitlines()) >= steps

    config = orchestrate_config(Path(plan.config.model.name_or_path), plan.config.train.seq_len, steps, work)
    run = gpu_check.run_plan(config, hw, run_dir, timeout_s, stop_when=logged)
    got = gpu_check.measured(run_dir)
    status = "ok" if got.get("steps", 0) >= steps else f"failed (rc {run['rc']}): {run['log_tail'][-600:]}"
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"status": status, "seconds": run["seconds"], **got}


# --- the peers: one process each, capped ------------------------------------------------------------------

def load_peer(peer: str, base: Path | None, max_seq: int):
    """(model with LoRA adapters, tokenizer, device): the NF4 8B base on the GPU, or a tiny fp32 Llama on the
    CPU (--dry-run's code-path check, base None)."""
    import torch

    from orchestrate.data.tokenizer import byte_tokenizer_fast

    tokenizer = byte_tokenizer_fast()
    tokenizer.pad_token = tokenizer.eos_token
    if peer == "unsloth":
        from unsloth import FastLanguageModel

        model, _ = FastLanguageModel.from_pretrained(model_name=str(base), max_seq_length=max_seq,
                                                     dtype=torch.bfloat16, load_in_4bit=True)
        model = FastLanguageModel.get_peft_model(model, r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0,
                                                 target_modules=SEVEN, use_gradient_checkpointing="unsloth",
                                                 max_seq_length=max_seq)
        return model, tokenizer, "cuda"
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    if base is None:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA))
        device = "cpu"
    else:
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(base, quantization_config=quant, dtype=torch.bfloat16,
                                                     device_map={"": 0})
        device = "cuda"
    model.config.use_cache = False
    lora = peft.LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=SEVEN,
                           task_type="CAUSAL_LM")
    return peft.get_peft_model(model, lora), tokenizer, device


def train_peer(peer: str, model, tokenizer, device: str, seq_len: int, steps: int, optim: str) -> dict:
    """`steps` SFTTrainer steps at `seq_len`: {"fits", "tokens_per_s", peaks} (fits False on a CUDA OOM)."""
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.ends = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    gen = torch.Generator().manual_seed(seq_len)
    rows = torch.randint(0, VOCAB_USED, (steps, seq_len), generator=gen).tolist()
    times = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                         max_steps=steps, max_length=seq_len, learning_rate=1e-4, optim=optim,
                         bf16=device == "cuda", use_cpu=device == "cpu", logging_steps=1, save_strategy="no",
                         report_to="none", packing=False, dataloader_num_workers=0,
                         # Unsloth's own checkpointing is set on its adapters (use_gradient_checkpointing)
                         gradient_checkpointing=peer != "unsloth",
                         gradient_checkpointing_kwargs={"use_reentrant": False})
        trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_dict({"input_ids": rows}), callbacks=[times])
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            trainer.train()
            fits = True
        except torch.OutOfMemoryError:
            fits = False
        result = {"seq_len": seq_len, "fits": fits}
        if device == "cuda":
            result.update(max_allocated_bytes=torch.cuda.max_memory_allocated(),
                          max_reserved_bytes=torch.cuda.max_memory_reserved())
        if fits:
            durations = [b - a for a, b in itertools.pairwise(times.ends)][1:] or [times.ends[-1] - times.ends[0]]
            result["tokens_per_s"] = seq_len / statistics.median(durations)  # after the first step (warm-up)
        del trainer
    for p in model.parameters():  # an OOM mid-backward leaves gradients behind
        p.grad = None
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def peer_main(args) -> int:
    """In the peer's process: cap the card, load, search the longest length, write the JSON."""
    if args.peer == "unsloth":
        import unsloth  # noqa: F401  (first: it patches transformers, peft and trl as they import)
    import torch

    from bench.gpu_worker import cap_fraction

    start = time.monotonic()
    result: dict = {"method": args.peer}
    base = Path(args.base) if args.base else None
    if base is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_fraction(args.cap_bytes, total), 0)
    model, tokenizer, device = load_peer(args.peer, base, args.max_seq)
    result["load_s"] = time.monotonic() - start
    tries: list[dict] = []

    def save(done: bool) -> None:
        """After every try: a peer killed at its timeout still leaves the longest it trained so far."""
        best = max((t for t in tries if t["fits"]), key=lambda t: t["seq_len"], default=None)
        result.update(tries=tries, best=best, seconds=time.monotonic() - start)
        if base is not None:
            result.update(longest_seq_len=best["seq_len"] if best else 0, bounded_by_time=not done)
        Path(args.json).write_text(json.dumps(result, indent=1))

    def fits(n: int) -> bool:
        tries.append(train_peer(args.peer, model, tokenizer, device, n, args.steps, args.optim))
        print(f"{args.peer}: seq {n} {'fits' if tries[-1]['fits'] else 'OOM'}", flush=True)
        save(done=False)
        return tries[-1]["fits"]

    if base is None:  # --dry-run: one short run of the code path, no search
        fits(64)
        save(done=True)
    else:
        length = longest(fits, args.max_seq, PEER_STEP, start + args.deadline_s)
        # complete when the next length failed (or is past --max-seq), not when the deadline cut the search
        failed = {t["seq_len"] for t in tries if not t["fits"]}
        save(done=length + PEER_STEP > args.max_seq or length + PEER_STEP in failed)
    return 0


def run_peer(peer: str, base: Path | None, args, optim: str, timeout_s: float, work: Path) -> dict:
    """A peer in its own process (its own cap; Unsloth's patches stay there); its JSON, or why none."""
    out = work / f"{peer}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--peer", peer, "--json", str(out), "--optim", optim,
           "--steps", str(args.steps), "--max-seq", str(args.max_seq), "--cap-bytes", str(args.cap_bytes),
           "--deadline-s", str(max(30.0, timeout_s - 60))]  # the last try and the exit inside the timeout
    if base is not None:
        cmd += ["--base", str(base)]
    log = work / f"{peer}.log"
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if out.is_file():
        return json.loads(out.read_text())
    return {"method": peer, "skipped": f"no result (rc {rc}): {log.read_text(errors='replace')[-800:]}"}


# --- the table ------------------------------------------------------------------------------------------

def _gib(n) -> str:
    return f"{n / 2**30:.2f}" if n else "-"


def table_rows(results: list[dict]) -> list[dict]:
    """One row per method: longest seq, tokens/s, peaks (GiB), and what it says (skipped, bound, plan)."""
    rows = []
    for r in results:
        best = r.get("best") or {}
        notes = [r.get("skipped"), "lower bound: search stopped by time" if r.get("bounded_by_time") else None]
        if r.get("planned"):
            p = r["planned"]
            notes.append(f"plan {p['strategy']}: {_gib(p['gpu_bytes'])} GiB, allocator {_gib(p['gpu_allocator_bytes'])}")
        note = "; ".join(n for n in notes if n)
        rows.append({"method": r["method"], "longest_seq": r.get("longest_seq_len"),
                     "tokens_per_s": best.get("tokens_per_s"), "peak_allocated_gib": _gib(best.get("max_allocated_bytes")),
                     "peak_reserved_gib": _gib(best.get("max_reserved_bytes")), "note": note})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'method':<12} {'longest seq':>11} {'tokens/s':>9} {'peak alloc GiB':>14} {'peak reserved GiB':>17}  note")
    for r in rows:
        tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-"
        print(f"{r['method']:<12} {r['longest_seq'] or '-':>11} {tps:>9} {r['peak_allocated_gib']:>14} "
              f"{r['peak_reserved_gib']:>17}  {r['note']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default=".", help="where long_context.json goes ($OUT on a lent GPU)")
    parser.add_argument("--work", help="base weights and runs (default /dev/shm/long-context, else a temp dir)")
    parser.add_argument("--gpu-mem", default="8GiB")
    parser.add_argument("--cpu-mem", default="64GiB")  # bench/longest_seq_len.py's 1 x 8 GiB row
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-seq", type=int, default=16384)
    parser.add_argument("--budget-s", type=float, default=540)
    # the peer's own process (run_peer)
    parser.add_argument("--peer", choices=["trl", "unsloth"], help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--optim", default="adamw_torch", help=argparse.SUPPRESS)
    parser.add_argument("--cap-bytes", type=int, default=8 * 2**30, help=argparse.SUPPRESS)
    parser.add_argument("--deadline-s", type=float, default=120, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer:
        return peer_main(args)

    import importlib.util

    import torch

    from orchestrate.hardware.flags import HardwareFlags

    start = time.monotonic()
    cuda = torch.cuda.is_available() and not args.dry_run
    shm = Path("/dev/shm")
    work = Path(args.work or (shm / "long-context" if cuda and shm.is_dir() and shutil.disk_usage(shm).free > 20 * 2**30
                              else tempfile.mkdtemp(prefix="long-context-")))
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base-llama3.1-8b"
    if not (base / "config.json").is_file():
        from bench.random_base import write_config

        write_config(architecture(), base)
    # this machine's software as detected (liger-kernel lets the planner weigh fused kernels); no calibration file
    hw = HardwareFlags(gpus=1, gpu_mem=args.gpu_mem, cpu_mem=args.cpu_mem, calibration=False).resolve()
    args.cap_bytes = hw.gpu.memory_bytes
    no_gpu = "needs a CUDA GPU (" + ("--dry-run" if args.dry_run else "torch.cuda.is_available() is False") + ")"

    # orchestrate's own bound is the base's positions (its plan reaches past the peers' --max-seq on 8 GiB)
    length, plan = planned_longest(base, hw, args.steps, work, architecture()["max_position_embeddings"])
    mine: dict = {"method": "orchestrate", "longest_seq_len": length}
    optim = "adamw_torch"
    if plan is not None:
        mine["planned"] = gpu_check.prediction(plan)
        optim = TRL_OPTIM[plan.strategy.optimizer]
    print(f"orchestrate plans seq {length} on {args.gpu_mem}: {plan.chosen.name if plan else 'nothing fits'} "
          f"({time.monotonic() - start:.0f} s)", flush=True)
    results = [mine]
    if cuda:
        t = time.monotonic()
        qlora_zoo.write_weights_for(base)
        mine["base_write_s"] = time.monotonic() - t
        print(f"random bf16 base written in {mine['base_write_s']:.0f} s", flush=True)
    if not cuda:
        mine["skipped"] = f"planned only; the run {no_gpu}"
    elif plan is None:
        mine["skipped"] = "nothing fits the planned card"
    else:
        left = args.budget_s - (time.monotonic() - start)
        ran = run_orchestrate(plan, hw, work, args.steps, timeout_s=min(240.0, left * 0.4))
        mine["run"] = ran
        if ran["status"] == "ok":
            mine["best"] = {"seq_len": length, "tokens_per_s": ran["tokens_per_s"],
                            "max_allocated_bytes": ran["gpu_max_allocated_bytes"],
                            "max_reserved_bytes": ran["gpu_max_reserved_bytes"]}
        else:
            mine["skipped"] = ran["status"]
    skipped = {peer: f"skipped: {peer} is not importable here" for peer in ("trl", "unsloth")
               if importlib.util.find_spec(peer) is None}
    if not cuda:
        skipped.setdefault("unsloth", f"skipped: {no_gpu}")  # it refuses to import without one
    runnable = [peer for peer in ("trl", "unsloth") if peer not in skipped]
    for i, peer in enumerate(runnable):  # the time left shared between the peers still to run
        share = (args.budget_s - (time.monotonic() - start)) / (len(runnable) - i)
        r = run_peer(peer, base if cuda else None, args, optim, share if cuda else 300, work)
        if not cuda and "best" in r:
            r["skipped"] = f"tiny Llama on the CPU at seq 64 (the code path only); the search {no_gpu}"
        results.append(r)
    results += [{"method": peer, "skipped": why} for peer, why in skipped.items()]
    results.sort(key=lambda r: ["orchestrate", "trl", "unsloth"].index(r["method"]))
    rows = table_rows(results)
    print_table(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"dry_run": args.dry_run, "cuda": cuda, "gpu": torch.cuda.get_device_name(0) if cuda else None,
           "gpu_mem": args.gpu_mem, "steps": args.steps, "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "targets": SEVEN},
           "optim": optim, "seconds": time.monotonic() - start, "table": rows, "results": results}
    (out / "long_context.json").write_text(json.dumps(doc, indent=1, default=str))
    if cuda:
        for log in work.glob("*.log"):  # orchestrate's launch and each peer's output, beside the JSON
            shutil.copyfile(log, out / log.name)
        shutil.rmtree(base, ignore_errors=True)  # 16 GB of RAM under /dev/shm
    return 0


if __name__ == "__main__":
    sys.exit(main())
