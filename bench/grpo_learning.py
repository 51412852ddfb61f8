"""The learning check of GRPO (docs/grpo.md): on 2 CPU ranks, examples/grpo's tiny Llama-shaped model
with the byte tokenizer, first part-taught by SFT to repeat the word of "Repeat: <word>\\n" (a few
steps on prompt-completion records: it gets some right), then trained by GRPO with the exact-match
reward alone. Per seed: the held-out exact match of the SFT model (every held-out prompt sampled
`--generations` times at temperature 1: a GRPO evaluation at a learning rate that moves nothing),
after GRPO with the reward paying for the right answer, and after GRPO with a reward paying for a
wrong one (weight −1): it should rise, and fall. The last column is the mean `frac_reward_zero_std`
of the rewarded run: the share of prompt groups whose completions all scored alike (no advantage).

    .venv/bin/python bench/grpo_learning.py [--seeds 0 1 2] [--sft-steps 120] [--steps 120] [--lr 1e-3]
        [--generations 16] [--prompts 8] [--warmup 10] [--work DIR] [--short]
    --short: seed 0, 8 SFT steps, 4 GRPO steps (CI: the table's code path, too short to learn)
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.test_fault_tolerance import _launch  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo"
REWARD = {"kind": "exact_match", "column": "answer", "pattern": "^([^\\n]*)", "name": "exact_match"}
HELD_OUT = 40
RANKS = 2


def _write(root: Path, seed: int) -> None:
    train, held = runpy.run_path(str(EXAMPLE / "make_prompts.py"))["make"](400, HELD_OUT, seed)
    rows = {"prompts.jsonl": train, "held_out.jsonl": held,
            **{f"sft_{name}": [{"prompt": r["prompt"], "completion": r["answer"] + "\n"} for r in records]
               for name, records in (("prompts.jsonl", train), ("held_out.jsonl", held))}}
    for name, records in rows.items():
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in records))


def _run(root: Path, name: str, config: dict) -> Path:
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    code, out = _launch(path, root / name)
    if code != 0:
        raise RuntimeError(f"{name} failed ({code}): {out[-3000:]}")
    return root / name


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _held_out_exact_match(records: list[dict]) -> float:
    return [r for r in records if "eval_rewards/exact_match/mean" in r][-1]["eval_rewards/exact_match/mean"]


def _zero_std(records: list[dict]) -> float:
    shares = [r["frac_reward_zero_std"] for r in records if "frac_reward_zero_std" in r]
    return sum(shares) / len(shares)


def _runs(root: Path, seed: int, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """(held-out exact match of the SFT model, after GRPO rewarding the right answer, the wrong one;
    the rewarded run's mean frac_reward_zero_std)."""
    base = yaml.safe_load((EXAMPLE / "model.yaml").read_text())
    grpo = base.pop("grpo")
    # One micro-batch of `prompts / RANKS` prompts per rank and step; the evaluation covers every held-out
    # prompt once (HELD_OUT / prompts batches), each sampled `generations` times.
    micro = args.prompts // RANKS
    base["train"].update(seed=seed, output_dir=str(root), eval_batches=max(1, HELD_OUT // args.prompts))
    base["data"].update(validation_files=[str(root / "held_out.jsonl")])
    sft = {**base, "train": {**base["train"], "max_steps": args.sft_steps, "eval_every": args.sft_steps,
                             "global_batch_size": 16},
           "data": {**base["data"], "train_files": [str(root / "sft_prompts.jsonl")],
                    "validation_files": [str(root / "sft_held_out.jsonl")], "packing": False}}
    taught = _run(root, f"sft-{seed}", sft) / "model"
    model = {"name_or_path": str(taught)}
    data = {**base["data"], "train_files": [str(root / "prompts.jsonl")]}

    def rl(name: str, reward: dict, max_steps: int, lr: float) -> list[dict]:
        train = {**base["train"], "max_steps": max_steps, "eval_every": max_steps, "global_batch_size": args.prompts,
                 "micro_batch_size": micro, "optimizer": {**base["train"]["optimizer"], "lr": lr},
                 "schedule": {"warmup_steps": min(args.warmup, max_steps - 1)}}
        settings = {**grpo, "num_generations": args.generations, "rewards": [reward]}
        config = {**base, "model": model, "train": train, "data": data, "grpo": settings}
        return _records(_run(root, f"{name}-{seed}", config))

    before = _held_out_exact_match(rl("sft-eval", REWARD, 1, 1e-12))
    rewarded = rl("grpo-right", REWARD, args.steps, args.lr)
    wrong = _held_out_exact_match(rl("grpo-wrong", {**REWARD, "weight": -1.0}, args.steps, args.lr))
    return before, _held_out_exact_match(rewarded), wrong, _zero_std(rewarded)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--sft-steps", type=int, default=120)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=1e-3, help="GRPO's learning rate")
    parser.add_argument("--generations", type=int, default=16, help="completions per prompt (num_generations)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (global_batch_size)")
    parser.add_argument("--warmup", type=int, default=10, help="GRPO's warm-up steps")
    parser.add_argument("--work", type=Path, help="directory for the runs (default: a temporary one)")
    parser.add_argument("--short", action="store_true", help="seed 0, 8 SFT steps, 4 GRPO steps")
    args = parser.parse_args(argv)
    if args.short:
        args.seeds, args.sft_steps, args.steps = [0], 8, 4
    root = args.work or Path(tempfile.mkdtemp(prefix="grpo-learning-"))
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    print("seed  held-out exact match: SFT   GRPO right   GRPO wrong   zero-std groups")
    for seed in args.seeds:
        work = root / f"seed-{seed}"
        work.mkdir(exist_ok=True)
        _write(work, seed)
        before, right, wrong, zero_std = _runs(work, seed, args)
        print(f"{seed:4d} {before:26.3f} {right:12.3f} {wrong:12.3f} {zero_std:17.3f}", flush=True)
    print(f"({time.perf_counter() - start:.0f} s; runs in {root})")


if __name__ == "__main__":
    main()
