"""Preference records as views over a cache entry (records.py stores them; docs/preference.md).

Every record gives two sequences to a micro-batch: a pair its chosen and its rejected sequence; an
unpaired answer (KTO) itself and a mismatched one, its prompt followed by the answer of the record
before it in the stored order (cyclic): the KL estimate's (x, y') of Ethayarajh et al. 2024, §4.1,
fixed per record so a precomputed reference serves it too. Labels are the answer tokens (TRAINED)
and -100 elsewhere, each sequence's first label -100. A batch names, for every position, the sequence
it belongs to (`sequence`, -1 for padding): first sequences 0..n-1 (chosen, or the answers), then
n..2n-1 (rejected, or the mismatched ones), n = the records in the batch (`record_index`: their
documents in the cache entry; unpaired adds `desirable`).

- `PaddedPreferences` (`data.packing: false`): one sequence per row of seq_len, 2b rows for b records,
  with an attention_mask.
- `PackedPreferences` (`data.packing: true`): a micro-batch's records fitted whole into as few
  blocks of 2 x seq_len as they need (best-fit decreasing), position ids restarting at 0 for every
  sequence, no attention_mask: as for packed chat samples (orchestrate/data/sft_samples.py),
  transformers keeps each sequence's attention within it (a block-diagonal mask from the position ids,
  or flash-attention's varlen path: `flatten`).

Either view's samples are records: the sampler deals records, so `train.global_batch_size` counts
pairs (or answers) whether packed or not, as TRL's per_device_train_batch_size counts pairs with
padding_free too (trl/trainer/dpo_trainer.py `DPOTrainer.concatenated_forward` flattens a batch's
sequences into one row). Packing changes the rows a micro-batch takes, never the records in it: the
loss stays a mean over a step's records.

Sequences longer than seq_len follow `data.truncation` (orchestrate/data/sft_samples.py), over a
record's sequences alike: keep_answer (the default) cuts the prompt from the left by the same tokens in
both sequences of a pair (they share it), so both answers stay whole, a leading BOS kept; a record
whose answer does not fit is dropped and counted. An unpaired answer's mismatched sequence (its kept
prompt, the previous record's answer) is cut from the left of its prompt too when it is longer than
seq_len. keep_start cuts every sequence at seq_len (both keep the same prompt tokens; a record left
with a sequence without answer tokens is dropped and counted); drop drops the record; error refuses it.

What every view over chat-path samples shares is orchestrate/data/sft_samples.py's, used here: the
truncation policy (over a record's two sequences), the labels, a view's length and shape, the
held-out split and the summary's frame. What is a record's own stays here: its two sequences (a pair's
chosen and rejected, found by the stored lengths of each; an answer's mismatched one), the batches'
`sequence` numbering and extras, and the block of 2 x seq_len.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from orchestrate.data.blocks import IGNORE_INDEX
from orchestrate.data.cache import TokenStream
from orchestrate.data.packing import best_fit_decreasing
from orchestrate.data.sft_prepare import REJECTED, TRAINED
from orchestrate.data.sft_samples import (
    FIXES,
    SampleView,
    apply_truncation,
    flattened,
    held_out_views,
    labels_of,
    read_mask,
    summary,
    truncation_counts,
    window,
)
from orchestrate.errors import Problem, UserError
from orchestrate.methods.preference.config import UNPAIRED as UNPAIRED_LOSSES
from orchestrate.methods.preference.records import PAIRED, UNPAIRED

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KeptRecords:
    """The records of a stream that train, after the truncation policy."""

    docs: np.ndarray
    """Their documents in the stream."""
    sides: np.ndarray
    """(records, 2) int64: the stored length of each sequence (unpaired: the answer's, then 0)."""
    heads: np.ndarray
    cuts: np.ndarray
    """Each one's window, its sequences' alike (sft_samples.py `Truncation`)."""
    truncated: int
    dropped: int

    def subset(self, positions: np.ndarray) -> KeptRecords:
        return KeptRecords(self.docs[positions], self.sides[positions], self.heads[positions], self.cuts[positions],
                           self.truncated, self.dropped)


def stored_sides(stream: TokenStream, mask: np.ndarray, paired: bool) -> np.ndarray:
    """(documents, 2): a pair's chosen and rejected lengths (its REJECTED tokens end it); an unpaired
    record's length and 0."""
    offsets = np.asarray(stream.offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    if not paired:
        return np.stack([lengths, np.zeros_like(lengths)], axis=1)
    rejected = np.add.reduceat((np.asarray(mask) & REJECTED).astype(bool).astype(np.int64), offsets[:-1]) \
        if len(lengths) else np.zeros(0, np.int64)
    return np.stack([lengths - rejected, rejected], axis=1)


def kept_records(stream: TokenStream, mask: np.ndarray, seq_len: int, policy: str, where: str,
                 paired: bool) -> KeptRecords:
    sides = stored_sides(stream, mask, paired)

    def too_long(long: np.ndarray) -> UserError:
        first = int(long[0])
        return UserError(f"{len(long)} preference record(s) have a sequence longer than train.seq_len {seq_len}", [Problem(
            "data.truncation", f"record {first} of {where} has sequences of {' and '.join(map(str, sides[first][:1 + paired]))} "
            f"tokens (and {len(long) - 1} more records are too long)", FIXES)])

    # an unpaired record is one sequence: its second side (0 tokens) is no sequence to keep an answer in
    cut = apply_truncation(stream, mask, sides[:, :1 + paired], seq_len, policy, too_long)
    return KeptRecords(cut.keep, sides[cut.keep], cut.heads, cut.cuts, cut.truncated, cut.dropped)


class _Preferences(SampleView):
    def __init__(self, stream: TokenStream, mask: np.ndarray, kept: KeptRecords, seq_len: int, paired: bool,
                 keep_answer: bool):
        super().__init__(stream, mask, kept, seq_len)
        self.paired, self.keep_answer = paired, keep_answer

    @property
    def stream_key(self) -> str:
        """The cache entry's key (what the records were tokenised from)."""
        return str(self.stream.meta["key"])

    @property
    def documents(self) -> int:
        return len(self._offsets) - 1

    def _span(self, k: int, side: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask bits) of sequence `side` of kept record k, as the truncation policy kept it."""
        kept = self.kept
        start = int(self._offsets[kept.docs[k]]) + int(kept.sides[k, :side].sum())
        head, cut, length = int(kept.heads[k]), int(kept.cuts[k]), int(kept.sides[k, side])
        return window(self._tokens, start, length, head, cut).astype(np.int64), window(self._mask, start, length, head, cut)

    def _labelled(self, ids: np.ndarray, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids, bits = ids[: self.seq_len], bits[: self.seq_len]
        return ids, labels_of(ids, bits)

    def sequences(self, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, labels) of kept record k's two sequences, within seq_len (module docstring)."""
        if self.paired:
            return [self._labelled(*self._span(k, 0)), self._labelled(*self._span(k, 1))]
        ids, bits = self._span(k, 0)
        other_ids, other_bits = self._span((k - 1) % self.samples, 0)
        prompt = int(np.argmax(bits & TRAINED))  # the answer's first token
        answer = int(np.argmax(other_bits & TRAINED))
        # keep_answer: the prompt's earliest tokens (after its BOS) make room for the other answer
        head, over = int(self.kept.heads[k]), prompt + len(other_ids) - answer - self.seq_len
        kept = np.r_[0:head, head + over:prompt] if self.keep_answer and over > 0 else np.arange(prompt)
        mismatched = (np.concatenate([ids[kept], other_ids[answer:]]), np.concatenate([bits[kept], other_bits[answer:]]))
        return [self._labelled(ids, bits), self._labelled(*mismatched)]

    def desirable(self, k: int) -> bool:
        return not (int(self._mask[int(self._offsets[self.kept.docs[k]])]) & REJECTED)

    def prompt_and_answer(self, k: int) -> tuple[list[int], list[int]] | None:
        """Kept record k's prompt and its chosen (or desirable) answer (`train.eval_generate`)."""
        ids, bits = self._span(k, 0)
        if not self.paired and not self.desirable(k):
            return None
        trained = np.flatnonzero(bits & TRAINED)
        first = int(trained[0])
        return (ids[:first].tolist(), ids[first: int(trained[-1]) + 1].tolist()) if first > 0 else None

    def records_at(self, positions: np.ndarray) -> np.ndarray:
        """The kept records of these samples: one each."""
        return np.asarray(positions, dtype=np.int64)

    def _extras(self, records: list[int]) -> dict[str, torch.Tensor]:
        import torch

        out = {"record_index": torch.as_tensor(self.kept.docs[records], dtype=torch.int64)}
        if not self.paired:
            out["desirable"] = torch.tensor([self.desirable(k) for k in records], dtype=torch.bool)
        return out


class PaddedPreferences(_Preferences):
    @classmethod
    def like(cls, view: _Preferences) -> PaddedPreferences:
        """The records of `view`, padded one sequence per row."""
        return cls(view.stream, view._mask, view.kept, view.seq_len, view.paired, view.keep_answer)

    def batch(self, positions: list[int] | np.ndarray) -> dict[str, torch.Tensor]:
        import torch

        records = np.asarray(positions).tolist()
        n = len(records)
        ids = np.full((2 * n, self.seq_len), self._pad, dtype=np.int64)
        labels = np.full((2 * n, self.seq_len), IGNORE_INDEX, dtype=np.int64)
        attention = np.zeros((2 * n, self.seq_len), dtype=np.int64)
        sequence = np.full((2 * n, self.seq_len), -1, dtype=np.int64)
        for j, k in enumerate(records):
            for side, (seq_ids, seq_labels) in enumerate(self.sequences(k)):
                row, length = side * n + j, len(seq_ids)
                ids[row, :length], labels[row, :length] = seq_ids, seq_labels
                attention[row, :length], sequence[row, :length] = 1, row
        out = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(attention),
               "labels": torch.from_numpy(labels), "sequence": torch.from_numpy(sequence)}
        return {**out, **self._extras(records)}


class PackedPreferences(_Preferences):
    """Records, one per sample as padded (the sampler deals records, so a micro-batch holds
    micro_batch_size of them and a step global_batch_size, packed or not); `batch` fits its records whole
    into as few blocks of 2 x seq_len as they need (best-fit decreasing): between 1 and one per record."""

    def __init__(self, stream: TokenStream, mask: np.ndarray, kept: KeptRecords, seq_len: int, paired: bool,
                 keep_answer: bool, flatten: bool = False):
        super().__init__(stream, mask, kept, seq_len, paired, keep_answer)
        self.flatten = flatten
        self.lengths = self.record_lengths()

    def record_lengths(self) -> np.ndarray:
        """Tokens each kept record takes in a block (both its sequences, each within seq_len)."""
        if self.paired:
            return np.minimum(self.kept.sides - self.kept.cuts[:, None], self.seq_len).sum(axis=1)
        return np.array([sum(len(ids) for ids, _ in self.sequences(k)) for k in range(self.samples)], dtype=np.int64)

    @property
    def fill(self) -> float:
        """The share of a block of 2 x seq_len an average record takes: about the rows a packed
        micro-batch needs per record when it holds many."""
        return float(self.lengths.mean()) / (2 * self.seq_len) if self.samples else 0.0

    def packed(self, records: list[int]) -> list[list[int]]:
        """These records in blocks of 2 x seq_len, each block's in order (best-fit decreasing, longest first)."""
        blocks = best_fit_decreasing(self.lengths[records], 2 * self.seq_len)
        return [[records[i] for i in blocks.of(b).tolist()] for b in range(len(blocks))]

    def batch(self, positions: list[int] | np.ndarray) -> dict[str, torch.Tensor]:
        import torch

        blocks = self.packed(np.asarray(positions, dtype=np.int64).tolist())
        rows, width = len(blocks), 2 * self.seq_len
        ids = np.full((rows, width), self._pad, dtype=np.int64)
        labels = np.full((rows, width), IGNORE_INDEX, dtype=np.int64)
        pos = np.zeros((rows, width), dtype=np.int64)
        sequence = np.full((rows, width), -1, dtype=np.int64)
        records = [k for block in blocks for k in block]
        n, j = len(records), 0
        for row, block in enumerate(blocks):
            at = 0
            for k in block:
                for side, (seq_ids, seq_labels) in enumerate(self.sequences(k)):
                    length = len(seq_ids)
                    cut = slice(at, at + length)
                    ids[row, cut], labels[row, cut], pos[row, cut] = seq_ids, seq_labels, np.arange(length)
                    sequence[row, cut] = side * n + j
                    at += length
                j += 1
            pos[row, at:] = np.arange(width - at)  # the padding: a segment of its own, never scored
        out = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
               "position_ids": torch.from_numpy(pos), "sequence": torch.from_numpy(sequence)}
        if self.flatten:
            out = flattened(out)
        return {**out, **self._extras(records)}


PreferenceSamples = PaddedPreferences | PackedPreferences


def check_preference_records(section, record_format: str, where: str) -> None:
    """The run's preference section (`section`) trains on records of one format: pairs for the
    pairwise losses, labelled answers for kto (preference records without a section:
    orchestrate/data/method_data.py)."""
    wanted = UNPAIRED if section.loss in UNPAIRED_LOSSES else PAIRED
    if record_format != wanted:
        columns = ("prompt, completion and label (true: desirable)" if wanted == UNPAIRED
                   else "chosen and rejected (and prompt)")
        raise UserError(f"preference.loss {section.loss} trains on {wanted} records", [Problem(
            where, f"the records are {record_format} records", f"give records with the columns {columns} "
            "(data.columns renames them), or choose a loss for them in preference.loss")])


def preference_views(train: TokenStream, validation: TokenStream | None, config,
                     flatten: bool) -> tuple[PreferenceSamples, PreferenceSamples]:
    """(train, validation) views of preference streams: the truncation policy, whole records held out
    by `validation_ratio` (when no validation data is given), then packed or padded."""
    seq_len, data = config.train.seq_len, config.data
    paired = train.meta.get("record_format") == PAIRED

    def view(stream: TokenStream, kept: KeptRecords, validating: bool) -> PreferenceSamples:
        keep_answer = data.truncation == "keep_answer"
        if data.packing:  # validation is labelled as training: a preference loss is on the answers anyway
            return PackedPreferences(stream, read_mask(stream), kept, seq_len, paired, keep_answer, flatten)
        return PaddedPreferences(stream, read_mask(stream), kept, seq_len, paired, keep_answer)

    def kept_of(stream: TokenStream, where: str) -> KeptRecords:
        return kept_records(stream, read_mask(stream), seq_len, data.truncation, where, paired)

    return held_out_views(train, validation, config, kept_of, view)


def describe_preferences(stream: TokenStream, train: PreferenceSamples, validation: PreferenceSamples, config,
                         tokenized: list[str], seconds: float) -> str:
    """The data summary of preference records: what they are, the records per split, packing, and
    every record cut or dropped."""
    seq_len = config.train.seq_len
    what = "pairs" if train.paired else "answers"
    if isinstance(train, PackedPreferences):
        split = (f"{train.samples:,} train / {validation.samples:,} validation {what}, each micro-batch's packed "
                 f"into blocks of {2 * seq_len} (a record fills {100 * train.fill:.1f} % of one on average)")
    else:
        split = f"{train.samples:,} train / {validation.samples:,} validation {what}, each sequence padded to {seq_len}"
    counts = truncation_counts(stream.meta, train.kept, config, "an answer without tokens",
                               f"a sequence with no answer token in its first {seq_len}")
    return summary(stream, tokenized, seconds, what, split, counts)
