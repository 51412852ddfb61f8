"""Generated chats for examples/chat-sft (no download): "upper-case this word" conversations.

Each chat: an optional system message, a user turn asking, in one of several phrasings and often after
an unrelated sentence, for a word in capital letters, and the assistant's answer, the word upper-cased.
The held-out prompts (held_out.jsonl) ask for the same words in phrasings and sentences the training
chats did not combine. A model that learned the task answers them exactly; one that learned only to
continue text does not.

Beside chats.jsonl it writes the same task in two other shapes, for examples/chat-sft/mix.yaml
(docs/sft.md "Several datasets"): alpaca.jsonl (instruction / input / output) and sharegpt.jsonl
(conversations of from / value), each with the system message in a `system` column as LLaMA-Factory's
formats hold it.

    python examples/chat-sft/make_chats.py OUT_DIR [--chats 600] [--held-out 60] [--alpaca 200] [--sharegpt 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ["apple", "river", "garden", "window", "silver", "market", "castle", "forest", "pepper", "rocket",
         "winter", "summer", "guitar", "pillow", "candle", "ladder", "mirror", "basket", "button", "camera",
         "dragon", "engine", "finger", "hammer", "island", "jacket", "kitten", "lemon", "magnet", "needle",
         "orange", "parrot", "rabbit", "saddle", "tomato", "violin", "walnut", "yellow", "zipper", "anchor",
         "bridge", "carpet", "desert", "feather", "glove", "honey", "iron", "jungle", "kettle", "lantern"]
ASKS = ["Upper-case this word: {w}", "Write {w} in capital letters.", "Shout the word {w}!",
        "Please capitalise every letter of {w}.", "How is {w} written in upper case?", "Make {w} loud.",
        "Turn {w} into capitals.", "{w} in block letters, please."]
SUBJECTS = ["my neighbour", "the teacher", "a small dog", "our old cat", "the farmer", "my sister", "a tired pilot"]
VERBS = ["saw", "painted", "found", "carried", "forgot", "wanted", "sold", "visited"]
OBJECTS = ["a red boat", "the blue house", "an empty box", "three green bottles", "the long road", "a quiet park"]
SYSTEMS = ["You are a helpful assistant.", "You answer with one word.", "Be brief."]


FILLER = [w for phrase in SUBJECTS + OBJECTS for w in phrase.split()] + VERBS + [
    "notes", "list", "today", "after", "before", "quickly", "under", "above", "seven", "twelve", "blue", "tiny",
    "heavy", "paper", "stone", "glass", "music", "north", "south", "cloud", "storm", "bread", "salt", "milk",
    "train", "ticket", "letter", "number", "corner", "street", "station", "morning", "evening", "coffee"]


def _sentence(rng: random.Random) -> str:
    """Context before the question: a few words in no particular order (text no model can predict)."""
    return "Notes: " + " ".join(rng.choice(FILLER) for _ in range(rng.randint(8, 16))) + "."


def chat(rng: random.Random, word: str, ask: str) -> dict:
    prompt = ask.format(w=word)
    if rng.random() < 0.7:
        prompt = f"{_sentence(rng)} {prompt}"
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.5 else []
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": word.upper()}]
    return {"messages": messages}


def make(chats: int, held_out: int, seed: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    pairs = [(w, a) for w in WORDS for a in ASKS]
    rng.shuffle(pairs)
    # every word keeps some phrasings unseen in training: the held-out prompts combine those
    held = {}
    for w, a in pairs:
        if w not in held:
            held[w] = a
    train_pairs = [(w, a) for w, a in pairs if held.get(w) != a]
    train = [chat(rng, *rng.choice(train_pairs)) for _ in range(chats)]
    test_words = [WORDS[i % len(WORDS)] for i in range(held_out)]
    test = [chat(rng, w, held[w]) for w in test_words]
    return train, test


def _system(chat: dict) -> dict:
    system = [m["content"] for m in chat["messages"] if m["role"] == "system"]
    return {"system": system[0]} if system else {}


def as_alpaca(chat: dict) -> dict:
    """The chat as an Alpaca record: the question the instruction, the answer the output."""
    user, answer = chat["messages"][-2]["content"], chat["messages"][-1]["content"]
    return {**_system(chat), "instruction": user, "input": "", "output": answer}


def as_sharegpt(chat: dict) -> dict:
    """The chat as a ShareGPT record: human and gpt turns of from / value."""
    turns = [m for m in chat["messages"] if m["role"] != "system"]
    return {**_system(chat), "conversations": [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                                               for m in turns]}


FACTS = ["The word {w} in capital letters is {W}.", "{w} becomes {W} in capitals.", "In block letters, {w} is {W}.",
         "Shouted, {w} reads {W}."]


def base_corpus(lines: int, seed: int) -> list[str]:
    """Plain text for the tiny base's pre-training: notes and sentences that pair each word with its
    upper-case form (what a pretrained model knows before it is taught to answer in chats)."""
    rng = random.Random(seed + 1)
    out = []
    for _ in range(lines):
        w = rng.choice(WORDS)
        fact = rng.choice(FACTS).format(w=w, W=w.upper())
        out.append(f"{_sentence(rng)} {fact}" if rng.random() < 0.5 else fact)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--chats", type=int, default=600)
    parser.add_argument("--held-out", type=int, default=60)
    parser.add_argument("--alpaca", type=int, default=200)
    parser.add_argument("--sharegpt", type=int, default=300)
    parser.add_argument("--corpus-lines", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train, test = make(args.chats, args.held_out, args.seed)
    alpaca = [as_alpaca(c) for c in make(args.alpaca, 0, args.seed + 1)[0]]
    sharegpt = [as_sharegpt(c) for c in make(args.sharegpt, 0, args.seed + 2)[0]]
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("chats.jsonl", train), ("held_out.jsonl", test), ("alpaca.jsonl", alpaca),
                       ("sharegpt.jsonl", sharegpt)):
        (args.out / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (args.out / "base_corpus.txt").write_text("\n".join(base_corpus(args.corpus_lines, args.seed)) + "\n", encoding="utf-8")
    print(f"wrote {len(train)} chats, {len(test)} held-out prompts, {len(alpaca)} Alpaca and {len(sharegpt)} ShareGPT "
          f"records and {args.corpus_lines} lines of base text to {args.out}")


if __name__ == "__main__":
    main()
