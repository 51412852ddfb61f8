"""Preference pairs for the DPO run after examples/chat-sft's SFT run (dpo.yaml): the chats' prompts
(make_chats.py), the preferred answer the upper-cased word with an exclamation mark, the dispreferred
one the same word without. The SFT model answers without one; after DPO it should prefer the mark,
also for the held-out phrasings (held_out_pairs.jsonl, make_chats.py's held-out prompts).

    python examples/chat-sft/make_preferences.py OUT_DIR [--pairs 400] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import runpy
from pathlib import Path

_CHATS = runpy.run_path(str(Path(__file__).with_name("make_chats.py")))


def _pair(chat: dict) -> dict:
    *prompt, answer = chat["messages"]
    word = answer["content"]
    return {"chosen": [*prompt, {"role": "assistant", "content": f"{word}!"}],
            "rejected": [*prompt, {"role": "assistant", "content": word}]}


def make(pairs: int, seed: int) -> tuple[list[dict], list[dict]]:
    train, held_out = _CHATS["make"](pairs, 40, seed)
    return [_pair(c) for c in train], [_pair(c) for c in held_out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    train, held = make(args.pairs, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("pairs.jsonl", train), ("held_out_pairs.jsonl", held)):
        (args.out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(train)} pairs and {len(held)} held-out pairs in {args.out}")


if __name__ == "__main__":
    main()
