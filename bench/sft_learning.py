"""The learning check of chat fine-tuning (docs/sft.md): on 2 CPU ranks, the built-in worker with the
loss on the answers only, the own-loop reference (examples/chat-sft/own_loop.py: transformers' chat
template masks, padded batches, peft / bitsandbytes) and the built-in worker with the loss on every
token (`data.train_on_inputs: true`), under full fine-tuning, LoRA and QLoRA.

    .venv/bin/python bench/sft_learning.py [--methods full lora qlora] [--seeds 0 1 2] [--steps 50] [--work DIR]
    .venv/bin/python bench/sft_learning.py --short   # full, seed 0, 4 steps on a base pre-trained 4 steps (CI:
                                                     # the table's code path, too short to learn)

The task is examples/chat-sft's: a tiny Llama-shaped base pre-trained (base.yaml, 200 steps) on text
that pairs words with their upper-case forms, then taught in 50 steps of chats to answer "upper-case
this word" prompts; accuracy is the exact-match share of 60 held-out prompts (phrasings the chats
never combined with their word), greedy. The built-in runs report `eval_exact_match` of the same 60
(train.eval_generate: 60). Built-in: 4 packed blocks of 128 tokens per step (13.6 chats on average);
own loop: 14 padded chats per step; same lr (3e-3), warm-up, cosine schedule and LoRA settings. Each
seed (`train.seed`: data order; the own loop's LoRA init too) trains every arm again; the table gives
each seed's counts and their mean. About 5 minutes per seed on the 2-core CI machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.chat_sft import build_workspace, final_record, fine_tune, own_loop  # noqa: E402

SHORT_STEPS = 4


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["full", "lora", "qlora"], choices=["full", "lora", "qlora"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--work", type=Path, help="workspace directory (default: a temporary one)")
    parser.add_argument("--short", action="store_true",
                        help="full, seed 0, 4 steps, the base pre-trained 4 steps (overrides --methods, --seeds, --steps)")
    args = parser.parse_args(argv)
    if args.short:
        args.methods, args.seeds, args.steps = ["full"], [0], SHORT_STEPS
    root = args.work or Path(tempfile.mkdtemp(prefix="sft-learning-"))
    start = time.perf_counter()
    ws = build_workspace(root, base_steps=SHORT_STEPS if args.short else None)
    print(f"workspace {root} (chats, tokenizer, base) in {time.perf_counter() - start:.0f} s", flush=True)
    rows = []
    for method in args.methods:
        arms: dict[str, list[int]] = {"answers": [], "own": [], "every": []}
        for seed in args.seeds:
            sets = [f"train.method={method}", f"train.max_steps={args.steps}", f"train.seed={seed}", "train.eval_every=0",
                    "train.eval_generate=60"]
            answers = final_record(fine_tune(ws, f"{method}-answers-{seed}", sets))
            every = final_record(fine_tune(ws, f"{method}-all-tokens-{seed}", [*sets, "data.train_on_inputs=true"]))
            arms["answers"].append(round(60 * answers["eval_exact_match"]))
            arms["own"].append(own_loop(ws, f"{method}-own-loop-{seed}", method, args.steps, seed=seed))
            arms["every"].append(round(60 * every["eval_exact_match"]))
            print(f"{method} seed {seed}: built-in answers-only {arms['answers'][-1]}/60, own loop {arms['own'][-1]}/60, "
                  f"built-in every token {arms['every'][-1]}/60", flush=True)
        rows.append((method, arms))
    print("\n| method | built-in, answers only | own loop, answers only | built-in, every token |\n|---|---|---|---|")
    for method, arms in rows:
        cells = [f"{sum(v) / len(v):.1f}/60 ({', '.join(map(str, v))})" for v in arms.values()]
        print(f"| {method} | " + " | ".join(cells) + " |")
    print(f"\n{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
