"""The learning check of GRPO (docs/grpo.md): on 2 CPU ranks, examples/grpo's tiny Llama-shaped model
with the byte tokenizer, first part-taught by SFT to repeat the word of "Repeat: <word>\\n" (a few
steps on prompt-completion records: it gets some right), then trained by GRPO with the exact-match
reward alone. Per seed: the held-out exact match of the SFT model (sampled at temperature 1, a GRPO
evaluation at a learning rate that moves nothing), after GRPO with the reward paying for the right
answer, and after GRPO with a reward paying for a wrong one (weight −1): it should rise, and fall.

    .venv/bin/python bench/grpo_learning.py [--seeds 0 1 2] [--sft-steps 90] [--steps 60] [--lr 1e-4] [--work DIR] [--short]
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


def _write(root: Path, seed: int) -> None:
    train, held = runpy.run_path(str(EXAMPLE / "make_prompts.py"))["make"](400, 40, seed)
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


def _held_out_exact_match(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "eval_rewards/exact_match/mean" in r][-1]["eval_rewards/exact_match/mean"]


def _runs(root: Path, seed: int, sft_steps: int, steps: int, lr: float) -> tuple[float, float, float]:
    """(held-out exact match of the SFT model, after GRPO rewarding the right answer, the wrong one)."""
    base = yaml.safe_load((EXAMPLE / "model.yaml").read_text())
    grpo = base.pop("grpo")
    base["train"].update(seed=seed, output_dir=str(root), eval_batches=5)
    base["data"].update(validation_files=[str(root / "held_out.jsonl")])
    sft = {**base, "train": {**base["train"], "max_steps": sft_steps, "eval_every": sft_steps, "global_batch_size": 16},
           "data": {**base["data"], "train_files": [str(root / "sft_prompts.jsonl")],
                    "validation_files": [str(root / "sft_held_out.jsonl")], "packing": False}}
    taught = _run(root, f"sft-{seed}", sft) / "model"
    model = {"name_or_path": str(taught)}
    data = {**base["data"], "train_files": [str(root / "prompts.jsonl")]}

    def rl(name: str, reward: dict, max_steps: int, lr: float) -> float:
        train = {**base["train"], "max_steps": max_steps, "eval_every": max_steps,
                 "optimizer": {**base["train"]["optimizer"], "lr": lr}}
        config = {**base, "model": model, "train": train, "data": data, "grpo": {**grpo, "rewards": [reward]}}
        return _held_out_exact_match(_run(root, f"{name}-{seed}", config))

    before = rl("sft-eval", REWARD, 1, 1e-12)
    right = rl("grpo-right", REWARD, steps, lr)
    wrong = rl("grpo-wrong", {**REWARD, "weight": -1.0}, steps, lr)
    return before, right, wrong


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--sft-steps", type=int, default=90)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-4,
                        help="GRPO's learning rate (the SFT run's is the example's: a larger one undoes the SFT)")
    parser.add_argument("--work", type=Path, help="directory for the runs (default: a temporary one)")
    parser.add_argument("--short", action="store_true", help="seed 0, 8 SFT steps, 4 GRPO steps")
    args = parser.parse_args(argv)
    if args.short:
        args.seeds, args.sft_steps, args.steps = [0], 8, 4
    root = args.work or Path(tempfile.mkdtemp(prefix="grpo-learning-"))
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    print("seed  held-out exact match: SFT   GRPO right   GRPO wrong")
    for seed in args.seeds:
        work = root / f"seed-{seed}"
        work.mkdir(exist_ok=True)
        _write(work, seed)
        before, right, wrong = _runs(work, seed, args.sft_steps, args.steps, args.lr)
        print(f"{seed:4d} {before:26.3f} {right:12.3f} {wrong:12.3f}", flush=True)
    print(f"({time.perf_counter() - start:.0f} s; runs in {root})")


if __name__ == "__main__":
    main()
