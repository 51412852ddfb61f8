"""Chat and instruction samples as views over a cache entry's tokens and loss mask (mask.bin).

Labels are the token where the mask trains it and -100 elsewhere (the model shifts them); a
sample's first label is always -100, so in a packed block no sample learns from the one before it.
Validation views label the answers only (`ANSWER`), so eval_loss is the answer-token loss whatever
the training loss covers (`train_on_inputs`, `roles_to_train`): comparable between such runs.

- `PackedSamples` (`data.packing: true`): whole samples in blocks of seq_len (best-fit decreasing,
  packing.py), `position_ids` restarting at 0 for every sample and no `attention_mask`, from which
  transformers builds a block-diagonal causal mask (masking_utils `find_packed_sequence_indices`:
  sdpa, eager) or cuts the flash-attention kernel's varlen sequences (`flatten`: the micro-batch as one
  row of b * seq_len tokens, as `DataCollatorWithFlattening` gives it; flash_attention_2 accepts
  packed position ids for one row only). The padding at a block's end is a segment of its own.
- `PaddedSamples` (`data.packing: false`): one sample per row, padded, with an attention_mask.

Samples longer than seq_len follow `data.truncation` before either (`kept_samples`): cut to their
first seq_len tokens (and dropped when that leaves nothing to train), dropped, or an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from orchestrate.data.blocks import IGNORE_INDEX
from orchestrate.data.cache import TokenStream
from orchestrate.data.packing import Blocks, best_fit_decreasing
from orchestrate.data.sft_prepare import ANSWER, MASK_FILE, TRAINED
from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    import torch


def read_mask(stream: TokenStream) -> np.ndarray:
    path = stream.directory / MASK_FILE
    size = path.stat().st_size if path.is_file() else None
    if size != len(stream.tokens):
        raise UserError(f"the data cache entry {stream.directory} is damaged", [Problem(
            "data.cache_dir", f"{path} has {size if size is not None else 'no'} bytes, the entry {len(stream.tokens)} tokens",
            f"rebuild it with `orchestrate prepare CONFIG --force`, or delete {stream.directory}")])
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(len(stream.tokens),))


@dataclass(frozen=True)
class KeptSamples:
    """The samples of a stream that train, after the truncation policy."""

    ids: np.ndarray
    lengths: np.ndarray
    """Tokens each keeps (at most seq_len)."""
    truncated: int
    dropped: int
    """Dropped by `drop`, or by `truncate` when the first seq_len tokens train nothing."""

    def subset(self, positions: np.ndarray) -> KeptSamples:
        return KeptSamples(self.ids[positions], self.lengths[positions], self.truncated, self.dropped)


def kept_samples(stream: TokenStream, mask: np.ndarray, seq_len: int, policy: str, where: str) -> KeptSamples:
    lengths = np.diff(np.asarray(stream.offsets)).astype(np.int64)
    long = np.flatnonzero(lengths > seq_len)
    if len(long) and policy == "error":
        first = int(long[0])
        raise UserError(f"{len(long)} sample(s) are longer than train.seq_len {seq_len}", [Problem(
            "data.truncation", f"sample {first} of {where} has {lengths[first]} tokens (and {len(long) - 1} more are too "
            "long)", f"raise train.seq_len, or set data.truncation: truncate (cut to {seq_len}) or drop")])
    drop = np.zeros(len(lengths), dtype=bool)
    if policy == "drop":
        drop[long] = True
    else:  # truncate: a sample whose first seq_len tokens train nothing has nothing left to learn
        for d in long.tolist():
            start = int(stream.offsets[d])
            drop[d] = not (np.asarray(mask[start: start + seq_len]) & TRAINED).any()
    keep = np.flatnonzero(~drop)
    return KeptSamples(keep, np.minimum(lengths[keep], seq_len), 0 if policy == "drop" else len(long) - int(drop.sum()),
                       int(drop.sum()))


class _Samples:
    def __init__(self, stream: TokenStream, mask: np.ndarray, kept: KeptSamples, seq_len: int, labelled: int = TRAINED):
        self.seq_len, self.kept, self.labelled = seq_len, kept, labelled
        self._tokens, self._mask, self._offsets = stream.tokens, mask, stream.offsets
        self._pad = int(stream.meta["eos_id"])

    def _sample(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, labels) of kept sample k."""
        start = int(self._offsets[self.kept.ids[k]])
        end = start + int(self.kept.lengths[k])
        ids = np.asarray(self._tokens[start:end], dtype=np.int64)
        labels = np.where(np.asarray(self._mask[start:end]) & self.labelled, ids, IGNORE_INDEX)
        labels[0] = IGNORE_INDEX
        return ids, labels

    def prompt_and_answer(self, k: int) -> tuple[list[int], list[int]] | None:
        """Kept sample k cut before its last answer: the prompt a model answers, and the answer (None
        when the sample has no answer, or none that starts after a prompt)."""
        start = int(self._offsets[self.kept.ids[k]])
        answer = (np.asarray(self._mask[start: start + int(self.kept.lengths[k])]) & ANSWER) > 0
        if not answer.any():
            return None
        ids = np.asarray(self._tokens[start: start + len(answer)], dtype=np.int64).tolist()
        last = int(np.flatnonzero(answer)[-1])
        first = last
        while first > 0 and answer[first - 1]:
            first -= 1
        return (ids[:first], ids[first: last + 1]) if first > 0 else None

    @property
    def samples(self) -> int:
        return len(self.kept.ids)


class PackedSamples(_Samples):
    def __init__(self, stream: TokenStream, mask: np.ndarray, kept: KeptSamples, seq_len: int, labelled: int = TRAINED,
                 flatten: bool = False):
        super().__init__(stream, mask, kept, seq_len, labelled)
        self.blocks: Blocks = best_fit_decreasing(kept.lengths, seq_len)
        self.flatten = flatten

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.blocks), self.seq_len)

    def __len__(self) -> int:
        return len(self.blocks)

    def batch(self, positions: list[int] | np.ndarray) -> dict[str, torch.Tensor]:
        import torch

        rows = len(positions)
        ids = np.full((rows, self.seq_len), self._pad, dtype=np.int64)
        labels = np.full((rows, self.seq_len), IGNORE_INDEX, dtype=np.int64)
        pos = np.zeros((rows, self.seq_len), dtype=np.int64)
        for row, block in enumerate(np.asarray(positions).tolist()):
            at = 0
            for k in self.blocks.of(block).tolist():
                sample_ids, sample_labels = self._sample(k)
                n = len(sample_ids)
                ids[row, at: at + n], labels[row, at: at + n], pos[row, at: at + n] = sample_ids, sample_labels, np.arange(n)
                at += n
            pos[row, at:] = np.arange(self.seq_len - at)  # the padding: a segment of its own, never a target
        out = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels), "position_ids": torch.from_numpy(pos)}
        return {k: v.reshape(1, -1) for k, v in out.items()} if self.flatten else out


class PaddedSamples(_Samples):
    @property
    def shape(self) -> tuple[int, int]:
        return (self.samples, self.seq_len)

    def __len__(self) -> int:
        return self.samples

    def batch(self, positions: list[int] | np.ndarray) -> dict[str, torch.Tensor]:
        import torch

        rows = len(positions)
        ids = np.full((rows, self.seq_len), self._pad, dtype=np.int64)
        labels = np.full((rows, self.seq_len), IGNORE_INDEX, dtype=np.int64)
        attention = np.zeros((rows, self.seq_len), dtype=np.int64)
        for row, k in enumerate(np.asarray(positions).tolist()):
            sample_ids, sample_labels = self._sample(k)
            n = len(sample_ids)
            ids[row, :n], labels[row, :n], attention[row, :n] = sample_ids, sample_labels, 1
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(attention),
                "labels": torch.from_numpy(labels)}


SftSamples = PackedSamples | PaddedSamples


def sft_views(train: TokenStream, validation: TokenStream | None, config, flatten: bool) -> tuple[SftSamples, SftSamples]:
    """(train, validation) views of chat / instruction streams: the truncation policy, then whole samples
    held out by `validation_ratio` (when no validation data is given), then packed or padded."""
    from orchestrate.data.blocks import split_ids

    seq_len, data = config.train.seq_len, config.data

    def view(stream: TokenStream, kept: KeptSamples, labelled: int = TRAINED) -> SftSamples:
        if data.packing:
            return PackedSamples(stream, read_mask(stream), kept, seq_len, labelled, flatten)
        return PaddedSamples(stream, read_mask(stream), kept, seq_len, labelled)

    def kept_of(stream: TokenStream, where: str) -> KeptSamples:
        return kept_samples(stream, read_mask(stream), seq_len, data.truncation, where)

    kept = kept_of(train, "the training data")
    if validation is not None:
        if validation.meta.get("record_format") != train.meta.get("record_format"):
            raise UserError("the validation data is in another record format", [Problem(
                "data.validation_files", f"{validation.meta.get('record_format')} records, the training data has "
                f"{train.meta.get('record_format')}", "validate on records of the training data's format")])
        return view(train, kept), view(validation, kept_of(validation, "the validation data"), ANSWER)
    held = split_ids(len(kept.ids), data.validation_ratio, config.train.seed)
    rest = np.setdiff1d(np.arange(len(kept.ids)), held)
    return view(train, kept.subset(rest)), view(train, kept.subset(held), ANSWER)


def describe_sft(stream: TokenStream, train: SftSamples, validation: SftSamples, config, tokenized: list[str],
                 seconds: float) -> str:
    """The data summary of chat / instruction records: format, how the loss mask was found, the samples,
    blocks and packing efficiency, and every sample truncated or dropped."""
    meta, seq_len = stream.meta, config.train.seq_len
    how = f"tokenised {' and '.join(tokenized)} in {seconds:.1f} s" if tokenized else f"cache hit ({seconds:.2f} s)"
    template = f", chat template: {meta['template_origin']}" if meta.get("template_origin") else ""
    text = (f"data: {how}: {meta['record_format']} records, {int(meta['tokens']):,} tokens in {stream.num_documents:,} "
            f"samples; loss on {meta['mask_method']}{template}")
    if isinstance(train, PackedSamples):
        text += (f"\n  {train.samples:,} train samples in {len(train):,} blocks of {seq_len} (packing efficiency "
                 f"{100 * train.blocks.efficiency:.1f} %) / {validation.samples:,} validation samples in "
                 f"{len(validation):,} blocks")
    else:
        text += f"\n  {train.samples:,} train / {validation.samples:,} validation samples, padded to {seq_len}"
    counts = [(meta.get("dropped_untrained", 0), "dropped when tokenised: no trained token"),
              (train.kept.truncated, f"cut to seq_len {seq_len}"),
              (train.kept.dropped, f"dropped: longer than seq_len {seq_len} ({config.data.truncation})" if
               config.data.truncation == "drop" else f"dropped: nothing to train in their first {seq_len} tokens")]
    notes = [f"{n:,} {what}" for n, what in counts if n]
    return text + (f"\n  samples: {'; '.join(notes)}" if notes else "") + f"\n  cache: {stream.directory}"
