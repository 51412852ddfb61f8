"""Prompts for examples/grpo (and tests/methods/grpo, bench/grpo_learning.py): "Repeat: <word>\n"
whose answer is the word, for a tiny byte-level model to learn by reward alone. Run it to write
data/prompts.jsonl and data/held_out.jsonl."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ["cat", "dog", "sun", "sea", "red", "box", "cup", "pen", "map", "owl", "fig", "ink", "jam", "kit", "log",
         "mud", "net", "oak", "pig", "rug", "saw", "tea", "van", "web", "yak", "zip", "arm", "bee", "cow", "day"]


def make(prompts: int, held_out: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(training, held-out) records: `prompt` and the `answer` an exact-match reward compares."""
    rng = random.Random(seed)
    rows = [{"prompt": f"Repeat: {w}\n", "answer": w} for w in (rng.choice(WORDS) for _ in range(prompts + held_out))]
    return rows[:prompts], rows[prompts:]


if __name__ == "__main__":
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    train, held = make(400, 40, 0)
    for name, rows in (("prompts.jsonl", train), ("held_out.jsonl", held)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
