"""Join tokenised documents with EOS and cut the stream into fixed-length blocks.

A block is exactly `seq_len` tokens and serves as both input_ids and labels: Hugging Face causal
LMs shift the labels inside the loss, so a block of seq_len tokens trains seq_len - 1 predictions
and never feeds more than seq_len positions to the model (the planner's activation estimate and the
model's position limit both assume seq_len). The last partial block is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def pack(token_docs: Iterable[list[int]], eos_id: int, seq_len: int) -> torch.Tensor:
    """[num_blocks, seq_len] int64 tensor of the documents joined by `eos_id` (each ends with it)."""
    stream: list[int] = []
    for ids in token_docs:
        stream.extend(ids)
        stream.append(eos_id)
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


def split_validation(blocks: torch.Tensor, ratio: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hold out round(ratio * n) blocks chosen by a seeded permutation (at least one when ratio > 0
    and at least one block stays for training); returns (train, validation)."""
    n = blocks.shape[0]
    held = min(n - 1, max(1, round(ratio * n))) if ratio > 0 and n > 1 else 0
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    val_idx, _ = perm[:held].sort()
    train_idx, _ = perm[held:].sort()
    return blocks[train_idx], blocks[val_idx]
