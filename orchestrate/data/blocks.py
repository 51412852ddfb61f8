"""Samples as views over a memory-mapped token stream (`cache.TokenStream`); nothing is copied
until a batch is asked for, so every worker of a node shares the one page-cached file.

Packed: sample b is tokens[b*seq_len : (b+1)*seq_len] of the EOS-joined stream (the last partial
block is dropped). It serves as both input_ids and labels: Hugging Face causal LMs shift the labels
inside the loss, so seq_len tokens train seq_len - 1 predictions and never feed more than seq_len
positions to the model (what the planner and the position limit assume).

Padded (packing off): sample d is document d (with its EOS), truncated to seq_len and padded with
EOS; attention_mask marks the real tokens and labels are -100 on the padding (ignored by the loss).

A `Subset` picks which samples a split sees: all, the held-out ones, or all but the held-out ones,
in O(held-out) memory (no index array of every block).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from orchestrate.data.cache import TokenStream

if TYPE_CHECKING:  # torch is imported where a batch is made: planning and cache hits never need it
    import torch

IGNORE_INDEX = -100
"""Label value the Hugging Face causal-LM loss skips (CrossEntropyLoss ignore_index)."""


class Subset:
    """Positions 0..len-1 of a split, mapped to sample ids of the stream."""

    def __init__(self, total: int, held_out: np.ndarray, keep_held_out: bool):
        self.total = total
        self.held_out = np.asarray(held_out, dtype=np.int64)  # sorted, unique
        self.keep_held_out = keep_held_out
        # For the complement: the k-th held-out id minus k is how many kept ids precede it.
        self._gaps = self.held_out - np.arange(len(self.held_out), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.held_out) if self.keep_held_out else self.total - len(self.held_out)

    def ids(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if self.keep_held_out:
            return self.held_out[positions]
        return positions + np.searchsorted(self._gaps, positions, side="right")


def split_ids(total: int, ratio: float, seed: int) -> np.ndarray:
    """Sorted ids of the round(ratio * total) held-out samples (at least one when ratio > 0, and at
    least one stays for training), drawn by a generator seeded with `seed`."""
    held = min(total - 1, max(1, round(ratio * total))) if ratio > 0 and total > 1 else 0
    rng = np.random.default_rng([seed % 2**64, 1])
    return np.sort(rng.choice(total, size=held, replace=False)).astype(np.int64)


class PackedBlocks:
    def __init__(self, stream: TokenStream, seq_len: int, subset: Subset | None = None):
        n = len(stream.tokens) // seq_len
        self.seq_len = seq_len
        self._blocks = stream.tokens[: n * seq_len].reshape(n, seq_len)  # still a view of the map
        # `is not None`: an empty Subset is falsy, and `subset or ...` made validation_ratio 0 evaluate on every block.
        self.subset = subset if subset is not None else Subset(n, np.empty(0, np.int64), keep_held_out=False)

    @staticmethod
    def count(stream: TokenStream, seq_len: int) -> int:
        return len(stream.tokens) // seq_len

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.subset), self.seq_len)

    def __len__(self) -> int:
        return len(self.subset)

    def batch(self, positions: list[int] | np.ndarray) -> dict[str, torch.Tensor]:
        import torch

        ids = torch.from_numpy(self._blocks[self.subset.ids(positions)].astype(np.int64))
        return {"input_ids": ids, "labels": ids.clone()}


class PaddedDocuments:
    def __init__(self, stream: TokenStream, seq_len: int, subset: Subset | None = None):
        self.seq_len = seq_len
        self._tokens, self._offsets = stream.tokens, stream.offsets
        self._pad = int(stream.meta["eos_id"])
        self.subset = subset if subset is not None else Subset(stream.num_documents, np.empty(0, np.int64),
                                                                  keep_held_out=False)

    @staticmethod
    def count(stream: TokenStream, seq_len: int) -> int:
        return stream.num_documents

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.subset), self.seq_len)

    def __len__(self) -> int:
        return len(self.subset)

    def truncated(self) -> int:
        """Documents (EOS included) longer than seq_len, whose tail is cut off."""
        return int(np.count_nonzero(np.diff(self._offsets) > self.seq_len))

    def batch(self, positions: list[int] | np.ndarray) -> dict[str, torch.Tensor]:
        import torch

        docs = self.subset.ids(positions)
        ids = np.full((len(docs), self.seq_len), self._pad, dtype=np.int64)
        mask = np.zeros((len(docs), self.seq_len), dtype=np.int64)
        for row, d in enumerate(docs):
            start = int(self._offsets[d])
            end = min(int(self._offsets[d + 1]), start + self.seq_len)
            ids[row, : end - start] = self._tokens[start:end]
            mask[row, : end - start] = 1
        input_ids = torch.from_numpy(ids)
        labels = input_ids.masked_fill(torch.from_numpy(mask) == 0, IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": torch.from_numpy(mask), "labels": labels}


class LabelledDocuments(PaddedDocuments):
    """Padded documents whose `labels` are each document's class id (sequence classification)."""

    def __init__(self, stream: TokenStream, seq_len: int, labels: np.ndarray, subset: Subset | None = None):
        super().__init__(stream, seq_len, subset)
        self._labels = labels  # class id per document of the stream

    def batch(self, positions: list[int] | np.ndarray) -> dict[str, torch.Tensor]:
        import torch

        out = super().batch(positions)
        out["labels"] = torch.from_numpy(np.asarray(self._labels[self.subset.ids(positions)], dtype=np.int64))
        return out
