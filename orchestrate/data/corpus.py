"""A generated English-like demo corpus (no downloads), written as a .txt file of paragraphs."""

from __future__ import annotations

import os
import random
from pathlib import Path

# A small grammar: few enough words that a tiny model learns spelling and word order in tens of steps
# (loss falls far below the ~2.9 nats of English letter frequencies), varied enough not to be one string.
_NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jonas"]
_ADJECTIVES = ["small", "big", "old", "young", "happy", "quiet", "green", "red", "brave", "lazy", "clever", "tired"]
_NOUNS = ["cat", "dog", "bird", "fox", "horse", "child", "farmer", "teacher", "river", "tree", "house", "garden",
          "boat", "book", "apple", "letter"]
_VERBS = ["sees", "likes", "finds", "follows", "watches", "helps", "paints", "carries", "remembers", "visits"]
_INTRANSITIVE = ["sleeps", "sings", "runs", "waits", "laughs", "walks", "rests", "dreams"]
_PLACES = ["near the river", "in the garden", "under the tree", "at the market", "on the hill",
           "by the old house", "in the morning", "after dinner"]
_CONNECTIVES = ["Then", "Later", "Every day", "Today", "At night", "Once"]


def _noun_phrase(rng: random.Random) -> str:
    if rng.random() < 0.25:
        return rng.choice(_NAMES)
    det = rng.choice(["the", "a", "the", "my", "our"])
    if rng.random() < 0.5:
        return f"{det} {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    return f"{det} {rng.choice(_NOUNS)}"


def _sentence(rng: random.Random) -> str:
    subject = _noun_phrase(rng)
    if rng.random() < 0.3:
        body = f"{subject} {rng.choice(_INTRANSITIVE)}"
    else:
        body = f"{subject} {rng.choice(_VERBS)} {_noun_phrase(rng)}"
    if rng.random() < 0.4:
        body += " " + rng.choice(_PLACES)
    if rng.random() < 0.2:
        body = f"{rng.choice(_CONNECTIVES)} {body}"
    return body[0].upper() + body[1:] + "."


def demo_corpus(seed: int, documents: int = 2000) -> list[str]:
    """Deterministic English-like documents of 3-7 sentences (same seed -> same text)."""
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(3, 7))) for _ in range(documents)]


def write_demo_corpus(path: Path, seed: int) -> Path:
    """Write the demo corpus as a .txt file (blank line between documents) so users can read it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # several processes may write it at once
    tmp.write_text("\n\n".join(demo_corpus(seed)) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
