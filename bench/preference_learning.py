"""The learning check of preference tuning (docs/preference.md): on 2 CPU ranks, examples/preference's
tiny Llama-shaped model (built from its config, its initial weights the reference) tuned on 400
generated pairs whose chosen answer is the word in capitals, for every loss and method asked, over
seeds (`train.seed`: data order and, for a model built from its config, its initial weights).

    .venv/bin/python bench/preference_learning.py [--losses dpo ipo robust orpo kto] [--methods full lora qlora]
                                                  [--seeds 0 1 2] [--steps 40] [--work DIR] [--short]
    --short: dpo, full, seed 0, 10 steps (CI: the table's code path, too short to learn)

    .venv/bin/python bench/preference_learning.py --chat [--lrs 3e-3] [--betas 0.1] [--rpo-alphas none 1.0]
                                                  [--seeds 0] [--steps 80] [--set KEY=VALUE ...]

Per run: the reward accuracy of step 1 (0: the model is its reference, every reward 0) and the mean of
the last 10 steps; on the 40 held-out pairs (words never trained on) at the last evaluation the reward
accuracy and, for the losses with a reference, the held-out log-prob margin log π(chosen) − log π(rejected)
of the reference (the initial model: eval_logps_margin − eval_rewards/margins / β) and of the tuned model.
KTO trains on the same answers labelled (chosen desirable) and reports its desirable and undesirable
rewards instead. About 20 s per run on the 2-core CI machine.

--chat: does DPO keep the model talking? examples/chat-sft's task (tests/helpers/chat_sft.py builds its
workspace: chats, tokenizer, the tiny base): per seed the SFT run (model.yaml, QLoRA, 50 steps), then
examples/chat-sft/dpo.yaml on it (full fine-tuning, 80 steps) for every lr, beta and rpo_alpha asked
(make_preferences.py's 400 pairs: the chosen answer is the word with "!"; `--set train.method=qlora`
and the like apply to every DPO run), each answering the SFT run's 60 held-out prompts greedily at the
end (train.eval_generate: 60). Per run: the SFT model's exact match; the DPO model's answers that are
the right word (with or without "!") and those that are exactly the chosen answer; empty answers; the
held-out log-prob margin log π(chosen) − log π(rejected) of the SFT model (the reference) and of the
DPO model. About 1.5 minutes per run on the 2-core CI machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import runpy
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrate import api  # noqa: E402
from tests.helpers.chat_sft import EXAMPLE as CHAT  # noqa: E402
from tests.helpers.chat_sft import build_workspace, final_record, fine_tune  # noqa: E402
from tests.helpers.plans import cpu_hardware  # noqa: E402
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


def _chat_dpo(ws, sft: Path, name: str, sets: list[str]) -> dict:
    """examples/chat-sft/dpo.yaml on the SFT run's model, its held-out pairs the SFT run's held-out prompts
    (chosen: the word with "!"); its final record."""
    make = runpy.run_path(str(CHAT / "make_preferences.py"))
    train, _ = make["make"](400, 1)
    held = [make["_pair"](json.loads(line)) for line in (ws.data / "held_out.jsonl").read_text().splitlines()]
    for file, rows in (("pairs.jsonl", train), ("held_out_pairs.jsonl", held)):
        (ws.data / file).write_text("".join(json.dumps(r) + "\n" for r in rows))
    d, run_dir = ws.data, ws.root / name
    config = api.load_config(CHAT / "dpo.yaml", [
        f"model.name_or_path={sft / 'model'}", f"data.train_files=[{d / 'pairs.jsonl'}]",
        f"data.validation_files=[{d / 'held_out_pairs.jsonl'}]", f"data.tokenizer={d / 'tokenizer'}",
        f"data.cache_dir={ws.root / 'cache'}", f"train.output_dir={ws.root}", "train.eval_generate=60", *sets])
    result = api.launch(api.launch_request(config, cpu_hardware(2), run_dir=run_dir))
    if result.exit_code != 0:
        raise RuntimeError(f"{name} failed ({result.exit_code}): {result.messages[-5:]}")
    return final_record(run_dir)


def chat(root: Path, lrs: list[float], betas: list[float], alphas: list[str], seeds: list[int], steps: int | None,
         extra: list[str]) -> None:
    ws = build_workspace(root)
    print("seed  lr      beta  rpo_alpha  SFT exact  DPO right word  DPO exact (with !)  empty  held margin: SFT  DPO")
    for seed in seeds:
        sft = fine_tune(ws, f"sft-{seed}", ["train.max_steps=50", f"train.seed={seed}", "train.eval_generate=60"])
        sft_exact = round(60 * final_record(sft)["eval_exact_match"])
        for lr, beta, alpha in itertools.product(lrs, betas, alphas):
            sets = [f"train.optimizer.lr={lr}", *([f"train.max_steps={steps}"] if steps else []), f"train.seed={seed}",
                    f"preference.beta={beta}", f"preference.rpo_alpha={'null' if alpha == 'none' else alpha}", *extra]
            record = _chat_dpo(ws, sft, "-".join(["dpo", str(seed), str(lr), str(beta), alpha, *extra]), sets)
            rows = record["eval_generations"]
            right = sum(r["generated"].rstrip("!") == r["reference"].rstrip("!") for r in rows)
            empty = sum(not r["generated"] for r in rows)
            reference = record["eval_logps_margin"] - record["eval_rewards/margins"] / beta
            print(f"{seed:4d}  {lr:<7g} {beta:<5g} {alpha:>9s}  {sft_exact:6d}/60  {right:11d}/60  {round(60 * record['eval_exact_match']):15d}/60"
                  f"  {empty:5d}  {reference:16.2f}  {record['eval_logps_margin']:5.2f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--losses", nargs="+", default=["dpo", "ipo", "robust", "orpo", "kto"])
    parser.add_argument("--methods", nargs="+", default=["full", "lora", "qlora"], choices=["full", "lora", "qlora"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="steps per run (default: 40; --chat: dpo.yaml's 80)")
    parser.add_argument("--work", type=Path, help="directory for the runs (default: a temporary one)")
    parser.add_argument("--short", action="store_true",
                        help="dpo, full, seed 0, 10 steps (overrides --losses, --methods, --seeds, --steps)")
    parser.add_argument("--chat", action="store_true", help="DPO after examples/chat-sft's SFT run (module docstring)")
    parser.add_argument("--lrs", nargs="+", type=float, default=[3e-3], help="--chat: DPO learning rates")
    parser.add_argument("--betas", nargs="+", type=float, default=[0.1], help="--chat: DPO betas")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="--chat: a key=value for every DPO run")
    parser.add_argument("--rpo-alphas", nargs="+", default=["none", "1.0"], help="--chat: rpo_alpha values (none: off)")
    args = parser.parse_args(argv)
    if args.chat:
        start = time.perf_counter()
        chat(args.work or Path(tempfile.mkdtemp(prefix="chat-dpo-learning-")), args.lrs, args.betas, args.rpo_alphas,
             args.seeds if args.seeds != [0, 1, 2] else [0], args.steps, args.sets)
        print(f"({time.perf_counter() - start:.0f} s)")
        return
    args.steps = args.steps or 40
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
