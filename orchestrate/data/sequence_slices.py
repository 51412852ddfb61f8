"""One rank's slice of a micro-batch under sequence parallelism (orchestrate/backends/sequence_parallel.py).

What DeepSpeed's `UlyssesSPDataLoaderAdapter` does to a batch, without the adapter: it wraps a
DataLoader whose ranks read different samples, all-gathers the group's batches and replays each as N
micro-batches, which changes the steps' micro-batch count. Here the ranks of a group read the same
samples (the sampler is keyed by the data-parallel rank), so slicing is all that is left:

- labels shifted before slicing (`shift_labels`: the target of position i is token i + 1), so the
  last position of a slice keeps its target, the first token of the next slice;
- position_ids of the whole sequence, so rotary embeddings and the causal order stay global;
- no attention_mask: the all-to-all attention drops masks and attends causally, which right-padded
  samples (`PaddedDocuments`) allow, their padding being after every real token and -100 in the labels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

IGNORE = -100  # transformers' ignore_index for labels


def sequence_slice(batch: dict[str, torch.Tensor], index: int, parts: int) -> dict[str, torch.Tensor]:
    """Slice `index` of `parts` (dim 1) of a causal-LM micro-batch: input_ids, labels, shift_labels and
    position_ids (module doc). The sequence length must divide by `parts`."""
    import torch

    input_ids, labels = batch["input_ids"], batch["labels"]
    length = input_ids.shape[1]
    if length % parts:
        raise ValueError(f"a sequence of {length} tokens does not split into {parts} equal slices")
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[:, 1:]
    positions = torch.arange(length, dtype=torch.long).expand_as(input_ids)
    part = slice(index * length // parts, (index + 1) * length // parts)
    return {"input_ids": input_ids[:, part].contiguous(), "labels": labels[:, part].contiguous(),
            "shift_labels": shifted[:, part].contiguous(), "position_ids": positions[:, part].contiguous()}
