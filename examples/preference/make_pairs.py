"""Generated preference pairs for examples/preference (no download): a prompt asks for a word, the
preferred (chosen) answer writes it in capital letters, the dispreferred (rejected) one in small
letters. The rule is learnable from the pairs alone (answer tokens in upper case are preferred), and
held_out.jsonl asks for words the training pairs never contain, so a model whose held-out log-prob
margin log p(chosen) - log p(rejected) grows learnt the rule, not the pairs.

    python examples/preference/make_pairs.py OUT_DIR [--pairs 400] [--held-out 40] [--seed 0]
    python examples/preference/make_pairs.py OUT_DIR --messages   # chat message lists instead of strings
    python examples/preference/make_pairs.py OUT_DIR --unpaired   # KTO: each answer alone, with a label
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"
ASKS = ["Say {w}.", "The word is {w}:", "Repeat {w}:", "Answer with {w}."]


def _words(rng: random.Random, count: int) -> list[str]:
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6))))
    return sorted(words)


def pair(rng: random.Random, word: str, messages: bool) -> dict:
    prompt, chosen, rejected = rng.choice(ASKS).format(w=word), f" {word.upper()}", f" {word}"
    if not messages:
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    user = [{"role": "user", "content": prompt}]
    return {"chosen": [*user, {"role": "assistant", "content": chosen.strip()}],
            "rejected": [*user, {"role": "assistant", "content": rejected.strip()}]}


def make(pairs: int, held_out: int, seed: int, messages: bool = False) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    words = _words(rng, pairs + held_out)
    rng.shuffle(words)
    return ([pair(rng, w, messages) for w in words[:pairs]], [pair(rng, w, messages) for w in words[pairs:]])


def unpaired(pairs: list[dict]) -> list[dict]:
    """Each text pair as two labelled answers (KTO's records: prompt, completion, label)."""
    return [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in pairs for side in ("chosen", "rejected")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--held-out", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--messages", action="store_true")
    parser.add_argument("--unpaired", action="store_true")
    args = parser.parse_args()
    train, held = make(args.pairs, args.held_out, args.seed, args.messages)
    if args.unpaired:
        train, held = unpaired(train), unpaired(held)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("pairs.jsonl", train), ("held_out.jsonl", held)):
        (args.out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(train)} pairs and {len(held)} held-out pairs in {args.out}")


if __name__ == "__main__":
    main()
