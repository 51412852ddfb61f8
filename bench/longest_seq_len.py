"""The longest train.seq_len the planner fits for Llama-3.1-8B QLoRA (r=32 on all seven linear layers,
batch 1) on one to four cards, beside Unsloth's published context lengths and ALST's published points,
with the tokens/s the speed model gives there. The analytical model only (`orchestrate plan`), bisected
over lengths in steps of 64, every knob on "auto", so each row is the plan a user gets.

    .venv/bin/python bench/longest_seq_len.py [--short] [--method qlora] [--dpo]

Unsloth: docs "Unsloth benchmarks", context-length table (Llama-3.1-8B Instruct, 4-bit QLoRA on q, k, v, o,
gate, up, down, r=32, batch 1). ALST (arXiv 2506.13996, ArcticTraining projects/sequence-parallelism): full
fine-tuning of Llama-3.1-8B, ZeRO-3 with CPU offload, 500,000 tokens on one H100 80 GB, 1,200,000 on one
H200. Positions are raised to 2^21 for planning: RoPE takes any position, as ALST's runs past Llama-3.1's
131,072 did. Each profile plans for a GPU machine with liger-kernel installed (orchestrate's `gpu` extra);
"no Liger" is the longest without its fused kernels (their numerics have not run on a GPU here yet).
`--short`: the 8 GiB rows only (CI: tests/unit/planner/test_long_context_plan.py).
"""

from __future__ import annotations

import argparse
import time

from orchestrate import api
from orchestrate.errors import UserError
from orchestrate.hardware.flags import HardwareFlags
from orchestrate.planner.plan import RunPlan
from orchestrate.planning import plan_for

CONFIG = "examples/llama3-8b.yaml"
SETTINGS = ["train.lora.r=32", "train.global_batch_size=1", "model.architecture.max_position_embeddings=2097152"]
LIGER = "0.8.5"
UNSLOTH = {8: 2_972, 12: 21_848, 16: 40_724, 24: 78_475, 40: 153_977, 48: 191_728, 80: 342_733}
ALST_FULL = {80: 500_000}  # H100 80 GB, full fine-tuning (H200 141 GB: 1,200,000)
ROWS = [(1, 8, 64), (1, 12, 64), (1, 16, 64), (1, 24, 128), (1, 40, 128), (1, 48, 128), (1, 80, 256),
        (2, 8, 64), (4, 8, 64)]
"""(cards, GiB per card, GiB of host RAM)."""
TARGETS = {(1, 8): 8_192, (1, 24): 150_000, (1, 80): 500_000}
TWO_CARD_FACTOR = 1.8


def hardware(cards: int, gpu_gib: int, cpu_gib: int, liger: str | None = LIGER):
    """The profile of the row, with liger-kernel installed (or not: `liger` None)."""
    hw = HardwareFlags(gpus=cards, gpu_mem=f"{gpu_gib}GiB", cpu_mem=f"{cpu_gib}GiB", calibration=False).resolve()
    return hw.model_copy(update={"software": hw.software.model_copy(update={"liger_kernel": liger})})


def longest(method: str, extra: list[str], hw) -> tuple[int, object]:
    """(longest seq_len, the chosen candidate there) by bisection over multiples of 64 up to 2^21."""
    def chosen(seq_len: int):
        config = api.load_config(CONFIG, [f"train.method={method}", f"train.seq_len={seq_len}", *SETTINGS, *extra])
        try:
            plan = plan_for(config, hw)
        except UserError:  # e.g. a batch of 1 on two cards where no backend splits the sequence
            return None
        return plan.chosen if isinstance(plan, RunPlan) else None

    low, high = 0, 2 ** 21 // 64
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if chosen(64 * middle) else (low, middle - 1)
    return 64 * low, (chosen(64 * low) if low else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="qlora")
    parser.add_argument("--dpo", action="store_true", help="plan DPO pairs (preference.loss=dpo) instead of SFT")
    parser.add_argument("--short", action="store_true", help="the 8 GiB rows only")
    args = parser.parse_args()
    extra = ["preference.loss=dpo"] if args.dpo else []
    rows = [r for r in ROWS if r[1] == 8] if args.short else ROWS
    print(f"{'cards':>9} {'RAM':>7} {'longest':>9} {'tokens/s':>9} {'no Liger':>9} {'Unsloth':>8} {'ratio':>6} "
          f"{'GPU/rank':>9} {'host':>8}  plan")
    found: dict[tuple[int, int], int] = {}
    start = time.perf_counter()
    for cards, gpu_gib, cpu_gib in rows:
        seq, best = longest(args.method, extra, hardware(cards, gpu_gib, cpu_gib))
        unfused, _ = longest(args.method, extra, hardware(cards, gpu_gib, cpu_gib, liger=None))
        found[(cards, gpu_gib)] = seq
        unsloth = UNSLOTH.get(gpu_gib) if cards == 1 else None
        ratio = f"{seq / unsloth:.2f}" if unsloth else "-"
        speed = f"{best.speed.tokens_per_s:,.0f}" if best else "-"
        gpu = f"{best.memory.gpu_total / 2**30:.1f} GiB" if best else "-"
        host = f"{best.memory.cpu_total / 2**30:.0f} GiB" if best else "-"
        print(f"{cards:>2} x {gpu_gib:>2}GiB {cpu_gib:>4}GiB {seq:>9,} {speed:>9} {unfused:>9,} "
              f"{f'{unsloth:,}' if unsloth else '-':>8} {ratio:>6} {gpu:>9} {host:>8}  {best.name if best else 'none'}")
    print(f"({time.perf_counter() - start:.1f} s; ALST's published full fine-tuning point: "
          + ", ".join(f"{v:,} tokens on 1 x {k} GB" for k, v in ALST_FULL.items()) + ")")
    if args.dpo:
        return
    print("targets:")
    for (cards, gpu_gib), target in TARGETS.items():
        if (cards, gpu_gib) in found:
            seq = found[(cards, gpu_gib)]
            print(f"  {cards} x {gpu_gib} GiB >= {target:,}: {seq:,} {'met' if seq >= target else 'NOT MET'}")
    if (1, 8) in found and (2, 8) in found:
        one, two = found[(1, 8)], found[(2, 8)]
        print(f"  2 x 8 GiB >= {TWO_CARD_FACTOR} x one card ({TWO_CARD_FACTOR * one:,.0f}): {two:,} "
              f"({two / max(one, 1):.2f}x) {'met' if two >= TWO_CARD_FACTOR * one else 'NOT MET'}")


if __name__ == "__main__":
    main()
