"""What fits on 8 GiB cards: the README's table, printed as Markdown.

    .venv/bin/python bench/fits_8gb.py [--short]

Each row is `orchestrate.api.plan_from_file` of a config in examples/ (or of a stored GPU-check config)
with every knob on "auto" unless the row says otherwise, on a profile from
`HardwareFlags(gpus=N, gpu_mem="8GiB", cpu_mem=RAM, calibration=False)`: the "Generic 8 GB GPU" this
machine resolves without a GPU, and the library versions installed here (liger-kernel included). The
"longest" rows bisect `train.seq_len` in steps of 64 as bench/longest_seq_len.py does (its settings:
Llama-3.1-8B's shape from examples/llama3-8b.yaml, LoRA r=32, batch 1, positions raised to 2^21).

The rows marked "H200" are the GPU check's runs (bench/results/h200-2026-12-04, docs/gpu-check.md): each
stored config re-planned on the stored hardware profile (an H200 capped at 8 GiB, the session's library
versions) with the run's micro-batch and activation checkpointing pinned, so the plan is the strategy that
ran. "measured" is the run's `max_memory_reserved` plus what the process held outside the caching
allocator (CUDA context, kernels, cuBLAS, NCCL; read from its allocation history), the counterpart of the
plan's GPU figure, and its tokens/s over 6 steps. No other row has run on a GPU.

`--short`: without the bisections and the H200 rows (a few seconds; the CI check of this script).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from orchestrate import api  # noqa: E402
from orchestrate.hardware.flags import HardwareFlags  # noqa: E402
from orchestrate.planner.plan import RunPlan  # noqa: E402

GiB, MiB = 2**30, 2**20
RESULTS = ROOT / "bench" / "results" / "h200-2026-12-04"
LLAMA31 = ["train.lora.r=32", "train.global_batch_size=1", "model.architecture.max_position_embeddings=2097152"]

# (model, method, config, overrides, GPUs, host RAM)
ROWS = [
    ("GPT-2 XL shape", "full", "examples/gpt2-xl.yaml", [], 2, "64GiB"),
    ("TinyLlama-1.1B shape", "full", "examples/llama-1.1b.yaml", [], 1, "32GiB"),
    ("Llama-2-7B shape", "full", "examples/llama2-7b.yaml", [], 2, "128GiB"),
    ("Llama-2-7B shape", "LoRA", "examples/llama2-7b.yaml", ["train.method=lora"], 1, "32GiB"),
    ("Llama-3-8B shape", "full", "examples/llama3-8b.yaml", ["train.seq_len=1024"], 1, "32GiB"),
    ("Llama-3-8B shape", "QLoRA", "examples/llama3-8b.yaml", ["train.method=qlora", "train.seq_len=1024"], 1, "32GiB"),
    ("Llama-3-8B shape", "QLoRA", "examples/llama3-8b.yaml", ["train.method=qlora"], 1, "32GiB"),
    ("Llama-3-8B shape", "QLoRA + DPO", "examples/llama3-8b.yaml",
     ["train.method=qlora", "train.seq_len=1024", "preference.loss=dpo"], 1, "32GiB"),
    ("Llama-2-70B shape", "QLoRA", "examples/llama2-70b.yaml", ["train.method=qlora", "train.seq_len=1536"], 2, "128GiB"),
]
# (model, method, overrides, GPUs, host RAM): the longest train.seq_len that fits
LONGEST = [
    ("Llama-3.1-8B shape", "QLoRA r=32, batch 1", ["train.method=qlora"], 1, "64GiB"),
    ("Llama-3.1-8B shape", "QLoRA r=32 + DPO, batch 1", ["train.method=qlora", "preference.loss=dpo"], 1, "64GiB"),
]
# GPU-check run -> (model, method, the run's micro-batch and activation checkpointing, a note)
MEASURED = {
    "fsdp2-full-shard-cpu-offload": ("GPT-2 0.47B", "full", [8, True], ""),
    "zero2-optimizer-offload": ("GPT-2 0.47B", "full", [8, True],
                                "the peak is DeepSpeed's set-up, which reads the whole H200's free memory"),
    "zero3-parameter-offload": ("GPT-2 0.47B", "full", [8, True], "ran in eval mode: a bug, fixed since, not re-run"),
    "qlora-ddp-chunked-loss": ("Llama 0.89B", "QLoRA", [2, False], ""),
    "qlora-fsdp2-full-shard": ("Llama 0.89B", "QLoRA", [2, False], ""),
}


def _row(model: str, method: str, cards: str, plan, measured: str = "—", seq: int | None = None) -> str:
    if not isinstance(plan, RunPlan):
        closest = plan.candidates[0]
        return (f"| {model} | {method} | {cards} | {plan.config.train.seq_len:,} | nothing fits (exit 2); closest "
                f"`{closest.name}` | {closest.memory.gpu_total / GiB:.2f} | {closest.memory.cpu_total / GiB:.1f} | — "
                f"| {measured} |")
    c = plan.chosen
    return (f"| {model} | {method} | {cards} | {seq or plan.config.train.seq_len:,}{' (longest)' if seq else ''} "
            f"| `{c.name}` | {c.memory.gpu_total / GiB:.2f} | {c.memory.cpu_total / GiB:.1f} "
            f"| {c.speed.tokens_per_s:,.0f} | {measured} |")


def _flags(gpus: int, cpu_mem: str) -> HardwareFlags:
    return HardwareFlags(gpus=gpus, gpu_mem="8GiB", cpu_mem=cpu_mem, calibration=False)


def _longest(overrides: list[str], flags: HardwareFlags) -> tuple[int, object]:
    """(longest seq_len, its plan) by bisection over multiples of 64 up to 2^21."""
    def plan(seq_len: int):
        result = api.plan_from_file("examples/llama3-8b.yaml", [*overrides, *LLAMA31, f"train.seq_len={seq_len}"], flags)
        return result if isinstance(result, RunPlan) else None

    low, high = 0, 2**21 // 64
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if plan(64 * middle) else (low, middle - 1)
    return 64 * low, plan(64 * low)


def _measured_rows(work: Path) -> list[str]:
    from bench import cuda_trace, qlora_zoo
    from orchestrate.hardware.profile import HardwareProfile

    session = json.loads((RESULTS / "gpu_check.json").read_text())
    hw = HardwareProfile.model_validate(session["hardware"])
    rows = []
    for name, (model, method, (micro, checkpointing), note) in MEASURED.items():
        config = json.loads((RESULTS / "zoo" / f"{name}.config.json").read_text())
        if "name_or_path" in config["model"]:  # a QLoRA entry: its base's config.json, no weights
            config["model"]["name_or_path"] = str(qlora_zoo.prepare(qlora_zoo.ENTRIES[name]["base"], work))
        config["train"].update(output_dir=str(work), micro_batch_size=micro, activation_checkpointing=checkpointing)
        path = work / f"{name}.yaml"
        path.write_text(json.dumps(config))
        plan = api.plan_from_file(path, [], hw)
        ran = session["plans"][name]
        measured = ran["measured"]
        outside = cuda_trace.read(RESULTS / "traces" / f"zoo-{name}.json.gz")["summary"]["outside_allocator"]
        held = (measured["gpu_max_reserved_bytes"] + outside) / GiB
        same = isinstance(plan, RunPlan) and plan.chosen.name == ran["prediction"]["strategy"]
        text = f"{held:.2f} GiB, {measured['tokens_per_s']:,.0f} tok/s" + (f"; {note}" if note else "")
        if not same:
            text += f" (ran `{ran['prediction']['strategy']}`)"
        cards = f"1 x 8 GiB (H200 capped), {hw.cpu_memory_bytes // GiB} GiB"
        rows.append(_row(model, method, cards, plan, text))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="without the bisections and the H200 rows")
    args = parser.parse_args(argv)
    print("| model | method | cards, host RAM | seq_len | plan | GPU GiB/rank | host GiB | tokens/s (planned) "
          "| measured on a GPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, method, config, overrides, gpus, cpu_mem in ROWS:
        plan = api.plan_from_file(config, overrides, _flags(gpus, cpu_mem))
        print(_row(model, method, f"{gpus} x 8 GiB, {cpu_mem[:-3]} GiB", plan))
    if args.short:
        return 0
    for model, method, overrides, gpus, cpu_mem in LONGEST:
        seq, plan = _longest(overrides, _flags(gpus, cpu_mem))
        print(_row(model, method, f"{gpus} x 8 GiB, {cpu_mem[:-3]} GiB", plan, seq=seq))
    with tempfile.TemporaryDirectory(prefix="orchestrate-fits-8gb-") as tmp:
        for row in _measured_rows(Path(tmp)):
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
