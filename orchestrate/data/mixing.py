"""How many records each source of `data.datasets` gives the one training stream, and which ones.

- `weight`: shares of the mix, as LLaMA-Factory's `interleave_probs` and `datasets.interleave_datasets
  (probabilities=...)` take them. `data.stopping_strategy` first_exhausted: the largest mix that takes
  no record twice (its size is that of the source shortest for its share, divided by that share);
  all_exhausted: the smallest that takes every record (the sources short for their share repeat).
- `samples`: exactly that many (LLaMA-Factory's dataset_info `num_samples`, data/loader.py
  `_load_single_dataset`, which draws the records past the source's size with replacement; here every
  record is taken as many whole times as fit and the rest without replacement, so no record is taken
  more than once more than another).
- neither (and no weight anywhere): every record once.

A share's records are chosen by a generator seeded with (train.seed, the entry's index), in the
source's order: the same config takes the same records, and a change of seed, weights or counts is a
new cache entry (`Mix.identity`). Samples are counted as records: a record the template leaves with
nothing to train is dropped after, and counted in the data summary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig


@dataclass(frozen=True)
class Mix:
    """What `data.datasets` asks of the mix, per entry."""

    labels: tuple[str, ...]
    """Each entry's path as the YAML gives it (the data summary's names)."""
    weights: tuple[float | None, ...]
    samples: tuple[int | None, ...]
    stopping: str
    seed: int

    @classmethod
    def of(cls, config: RunConfig) -> Mix | None:
        entries = config.data.datasets
        if not entries:
            return None
        return cls(tuple(e.path for e in entries), tuple(e.weight for e in entries), tuple(e.samples for e in entries),
                   config.data.stopping_strategy, config.train.seed)

    @property
    def chooses(self) -> bool:
        """Whether any entry takes other than all its records once (then the seed decides which)."""
        return any(w is not None for w in self.weights) or any(s is not None for s in self.samples)

    def identity(self) -> dict:
        """The cache key's part: which records, how often (labels are no content: the sources' identity is)."""
        if not self.chooses:
            return {"entries": len(self.labels)}
        return {"weights": list(self.weights), "samples": list(self.samples), "stopping": self.stopping,
                "seed": self.seed}

    def counts(self, sizes: list[int]) -> list[int]:
        """The records each entry gives the mix, of `sizes` records each."""
        counts = [size if s is None else s for size, s in zip(sizes, self.samples, strict=True)]
        weighted = [i for i, w in enumerate(self.weights) if w is not None]
        if not weighted:
            return counts
        total_weight = sum(self.weights[i] for i in weighted)
        share = {i: self.weights[i] / total_weight for i in weighted}
        ratios = [sizes[i] / share[i] for i in weighted]
        mix = min(ratios) if self.stopping == "first_exhausted" else max(ratios)
        for i in weighted:
            counts[i] = round(share[i] * mix)
            if self.stopping == "first_exhausted":
                counts[i] = min(counts[i], sizes[i])  # a float's last bit never takes one record more
        return counts

    def chosen(self, listed: int, size: int, count: int) -> np.ndarray | None:
        """The positions of entry `listed`'s records (of `size`) that the mix takes, `count` of them in
        source order, a record repeated as often as it is taken; None: every record once."""
        if count == size:
            return None
        whole, rest = divmod(count, size) if size else (0, 0)
        rng = np.random.default_rng([self.seed, listed])
        extra = np.sort(rng.choice(size, rest, replace=False)) if rest else np.empty(0, np.int64)
        return np.concatenate([np.tile(np.arange(size), whole), extra]).astype(np.int64)

    def rows(self, listed: list[int | None], lengths: list[int]) -> tuple[list[np.ndarray | None], list[int]]:
        """For the parts of a stream (part k of entry `listed[k]` with `lengths[k]` records; an entry's
        parts in its order): the rows of each part the mix takes (None: all, once), and each entry's record count."""
        sizes = [sum(n for e, n in zip(listed, lengths, strict=True) if e == i) for i in range(len(self.labels))]
        counts = self.counts(sizes)
        out: list[np.ndarray | None] = [None] * len(listed)
        for i in range(len(self.labels)):
            chosen = self.chosen(i, sizes[i], counts[i])
            start = 0
            for k in (k for k, e in enumerate(listed) if e == i):
                end = start + lengths[k]
                if chosen is not None:
                    out[k] = chosen[(chosen >= start) & (chosen < end)] - start
                start = end
        return out, sizes

    def account(self, sizes: list[int], formats: list[str]) -> list[dict]:
        """meta.json's `mix`: per entry its name, record format, records, records taken and what asked
        for them."""
        return [{"source": label, "record_format": fmt, "records": size, "taken": count, "weight": weight,
                 "samples": samples}
                for label, fmt, size, count, weight, samples
                in zip(self.labels, formats, sizes, self.counts(sizes), self.weights, self.samples, strict=True)]


def mix_line(account: list[dict]) -> str:
    """The data summary's line of a mix: what each source gave, e.g. "chat.jsonl: 1,000 of 3,000
    records (weight 2.0)"."""
    parts = []
    for entry in account:
        taken, records, kind = entry["taken"], entry["records"], entry["record_format"]
        how = (f"weight {entry['weight']}" if entry["weight"] is not None else
               f"samples {entry['samples']:,}" if entry["samples"] is not None else None)
        text = (f"{entry['source']}: {taken:,} of {records:,} {kind} records" if how else
                f"{entry['source']}: all {records:,} {kind} records")
        if taken > records:
            text += f", each {taken // records} or {-(-taken // records)} times" if taken % records else \
                f", each {taken // records} times"
        parts.append(text + (f" ({how})" if how else ""))
    return "mix: " + "; ".join(parts)
