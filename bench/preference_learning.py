"""The learning check of preference tuning (docs/preference.md): on 2 CPU ranks, examples/preference's
tiny Llama-shaped model (built from its config, its initial weights the reference) tuned on 400
generated pairs whose chosen answer is the word in capitals, for every loss and method asked, over
seeds (`train.seed`: data order and, for a model built from its config, its initial weights).

    .venv/bin/python bench/preference_learning.py [--losses dpo ipo robust orpo kto] [--methods full lora qlora]
                                                  [--seeds 0 1 2] [--steps 40] [--work DIR] [--short]
    --short: dpo, full, seed 0, 10 steps (CI: the table's code path, too short to learn)

Per run: the reward accuracy of step 1 (0: the model is its reference, every reward 0) and the mean of
the last 10 steps; on the 40 held-out pairs (words never trained on) at the last evaluation the reward
accuracy and, for the losses with a reference, the held-out log-prob margin log π(chosen) − log π(rejected)
of the reference (the initial model: eval_logps_margin − eval_rewards/margins / β) and of the tuned model.
KTO trains on the same answers labelled (chosen desirable) and reports its desirable and undesirable
rewards instead. About 20 s per run on the 2-core CI machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.preference import PreferenceRuns  # noqa: E402

BETA = 0.1  # examples/preference/model.yaml


def _row(loss: str, method: str, seed: int, run_dir: Path) -> str:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if "eval_loss" in r][-1]
    if loss == "kto":
        return (f"{loss:7s} {method:6s} {seed:4d}   held-out rewards desirable {final['eval_rewards/chosen']:+.3f}, "
                f"undesirable {final['eval_rewards/rejected']:+.3f}")
    late = sum(r["rewards/accuracies"] for r in records[-10:]) / 10
    text = (f"{loss:7s} {method:6s} {seed:4d} {records[0]['rewards/accuracies']:8.2f} {late:9.3f} "
            f"{final['eval_rewards/accuracies']:9.3f}")
    if loss != "orpo":
        reference = final["eval_logps_margin"] - final["eval_rewards/margins"] / BETA
        text += f" {reference:12.3f} {final['eval_logps_margin']:10.3f}"
    else:
        text += f" {'-':>12s} {final['eval_logps_margin']:10.3f}"
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--losses", nargs="+", default=["dpo", "ipo", "robust", "orpo", "kto"])
    parser.add_argument("--methods", nargs="+", default=["full", "lora", "qlora"], choices=["full", "lora", "qlora"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--work", type=Path, help="directory for the runs (default: a temporary one)")
    parser.add_argument("--short", action="store_true",
                        help="dpo, full, seed 0, 10 steps (overrides --losses, --methods, --seeds, --steps)")
    args = parser.parse_args(argv)
    if args.short:
        args.losses, args.methods, args.seeds, args.steps = ["dpo"], ["full"], [0], 10
    root = args.work or Path(tempfile.mkdtemp(prefix="preference-learning-"))
    root.mkdir(parents=True, exist_ok=True)
    runs, start = PreferenceRuns(root), time.perf_counter()
    print("loss    method seed  acc@1  acc last10  held acc  held margin: ref      tuned")
    for loss in args.losses:
        settings = {"loss": loss, **({"label_smoothing": 0.1} if loss == "robust" else {})}
        for method in args.methods:
            for seed in args.seeds:
                run_dir = runs(f"{loss}-{method}-{seed}", method, args.steps, {"seed": seed}, **settings)
                print(_row(loss, method, seed, run_dir), flush=True)
    print(f"({time.perf_counter() - start:.0f} s; runs in {root})")


if __name__ == "__main__":
    main()
