"""Documents from local files, or a generated English-like demo corpus.

Document boundaries: in a .txt file every paragraph (text separated by one or more blank lines) is
one document, so a single file of many short texts works as well as many files; in a .jsonl file
every record's `text_field` is one document. Documents are later joined with the EOS id.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

from orchestrate.errors import Problem, UserError

_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def read_documents(path: Path, text_field: str, where: str) -> Iterator[str]:
    """Yield the non-empty documents of one .txt or .jsonl file; `where` names the config key."""
    if not path.is_file():
        raise UserError(f"data file {path} not found", [Problem(where, f"{path} does not exist",
                                                                "check the path (relative paths are "
                                                                "resolved against the YAML file's directory)")])
    if path.suffix == ".jsonl":
        yield from _read_jsonl(path, text_field, where)
    elif path.suffix == ".txt":
        for paragraph in _PARAGRAPH_BREAK.split(path.read_text(encoding="utf-8")):
            if paragraph.strip():
                yield paragraph.strip()
    else:
        raise UserError(f"cannot read {path}", [Problem(where, f"unsupported file type {path.suffix!r}",
                                                        "use .txt (blank-line separated documents) or .jsonl")])


def _read_jsonl(path: Path, text_field: str, where: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{lineno} is not valid JSON",
                                [Problem(where, f"{path}:{lineno}: {exc.msg}")]) from None
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise UserError(f"{path}:{lineno} has no field {text_field!r}",
                                [Problem("data.text_field", f"record {lineno} of {path} has no "
                                         f"{text_field!r} (it has: {keys})",
                                         "set data.text_field to the field that holds the text")])
            text = record[text_field]
            if not isinstance(text, str):
                raise UserError(f"{path}:{lineno}: field {text_field!r} is not a string",
                                [Problem("data.text_field", f"got {type(text).__name__}")])
            if text.strip():
                yield text


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
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n\n".join(demo_corpus(seed)) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
