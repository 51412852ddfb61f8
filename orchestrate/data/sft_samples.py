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

Samples longer than seq_len follow `data.truncation` before either (`kept_samples`, `apply_truncation`):

- keep_answer (the default): the prompt is cut from the left, so the sample keeps its last seq_len
  tokens: every answer and its end-of-turn token stay, the earliest context goes. A leading BOS token
  (the tokenizer's, meta.json `bos_id`) stays ahead of the cut, as a model was trained to see one. An
  answer (mask.bin's ANSWER bits) is kept whole or not at all: a cut that falls inside one, or leaves
  one first with nothing before it to predict its first token from, moves on to that answer's end, so
  a long chat keeps its last answers whole; a sample left with no answer (its last answer alone does
  not fit) or nothing to train is dropped and counted. Position ids restart at 0 at the kept tokens.
- keep_start: cut to their first seq_len tokens (and dropped when that leaves nothing to train);
- drop: dropped; error: an error naming the first.

A kept document is read through its window (`window`): its first `head` tokens (0, or 1 for its
BOS), then the rest after `cut` more tokens.

The rules every view over a cache entry's samples follows are here once, for these and for the
preference records built on them (orchestrate/methods/preference/samples.py): the truncation policy
over a document's sequences (`apply_truncation`), the labels (`labels_of`), a view's length and shape
(`SampleView`), the held-out split (`held_out_views`) and the data summary's frame (`summary`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np

from orchestrate.data.blocks import IGNORE_INDEX, split_ids
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


class Kept(Protocol):
    """What the truncation policy kept of a stream: `KeptSamples`, or a method's records built on them
    (orchestrate/methods/preference/samples.py `KeptRecords`)."""

    docs: np.ndarray
    """Their documents in the stream."""
    truncated: int
    dropped: int

    def subset(self, positions: np.ndarray) -> Kept: ...


K = TypeVar("K", bound=Kept)
V = TypeVar("V")


@dataclass(frozen=True)
class Truncation:
    """What `data.truncation` did to a stream's documents."""

    keep: np.ndarray
    """The documents kept."""
    heads: np.ndarray
    """Per kept document: the tokens kept ahead of the cut (1: its BOS, under keep_answer), else 0."""
    cuts: np.ndarray
    """Per kept document: the tokens cut after its head, from every sequence alike (keep_answer), else 0."""
    truncated: int
    """Documents kept, cut: their prompt from the left (keep_answer), their end (keep_start)."""
    dropped: int


@dataclass(frozen=True)
class KeptSamples:
    """The samples of a stream that train, after the truncation policy."""

    docs: np.ndarray
    """Their documents in the stream."""
    lengths: np.ndarray
    """Tokens each keeps (at most seq_len)."""
    heads: np.ndarray
    cuts: np.ndarray
    """Each one's window (`Truncation`): tokens kept ahead of the left cut, tokens cut after them."""
    truncated: int
    dropped: int
    """Dropped by `drop`, or by keep_answer / keep_start when what they keep trains nothing."""

    def subset(self, positions: np.ndarray) -> KeptSamples:
        return KeptSamples(self.docs[positions], self.lengths[positions], self.heads[positions], self.cuts[positions],
                           self.truncated, self.dropped)


def window(values, start: int, length: int, head: int, cut: int) -> np.ndarray:
    """A sequence stored at values[start: start + length] as kept: its first `head` values, then those
    after `cut` more."""
    if not cut:
        return np.asarray(values[start: start + length])
    return np.concatenate([values[start: start + head], values[start + head + cut: start + length]])


def _answer_cut(bits: np.ndarray, head: int, cut: int) -> int:
    """`cut` (tokens left out after the first `head`), moved on to the end of the answer it would cut in
    part, or leave first with no token before it (whose prediction is the answer's first token)."""
    at = head + cut
    answer = (bits & ANSWER) > 0
    if cut and at < len(bits) and answer[at] and (head == 0 or answer[at - 1]):
        rest = np.flatnonzero(~answer[at:])
        at += int(rest[0]) if len(rest) else len(bits) - at
    return at - head


def _keeps_something(bits: np.ndarray, head: int, cut: int) -> bool:
    """The window trains a token, and keeps an answer when the sequence has one."""
    kept = window(bits, 0, len(bits), head, cut)
    return bool((kept & TRAINED).any()) and (bool((kept & ANSWER).any()) or not (bits & ANSWER).any())


def _cut_from_left(firsts: list[int], bits: list[np.ndarray], seq_len: int, bos_id: int | None) -> tuple[int, int] | None:
    """(head, cut) of a long document's window under keep_answer, its sequences (their first ids and
    their mask bits) cut alike; None when it cannot keep an answer whole (the module docstring)."""
    head = int(bos_id is not None and all(first == bos_id and not b[0] & ANSWER for first, b in zip(firsts, bits, strict=True)))
    cut = max(_answer_cut(b, head, max(len(b) - seq_len, 0)) for b in bits)
    whole = all(_answer_cut(b, head, cut) == cut and _keeps_something(b, head, cut) for b in bits)
    return (head, cut) if whole else None


def apply_truncation(stream: TokenStream, mask: np.ndarray, sides: np.ndarray, seq_len: int, policy: str,
                     too_long: Callable[[np.ndarray], UserError]) -> Truncation:
    """`data.truncation` over a stream whose document d holds sequences of sides[d] tokens one after
    the other (a sample: one; a preference pair: its chosen, then its rejected; a length 0: none). A
    document is long when a sequence is longer than seq_len: error raises `too_long(the long
    documents)`; drop drops it; keep_answer cuts every sequence's prompt alike (`_cut_from_left`);
    keep_start cuts every sequence at seq_len and drops the document when one of them keeps no
    trained token (nothing left to learn or compare)."""
    long = np.flatnonzero(sides.max(axis=1) > seq_len)
    if len(long) and policy == "error":
        raise too_long(long)
    drop = np.zeros(len(sides), dtype=bool)
    heads, cuts = np.zeros(len(sides), dtype=np.int64), np.zeros(len(sides), dtype=np.int64)
    if policy == "drop":
        drop[long] = True
    for d in long.tolist() if policy != "drop" else []:
        starts = int(stream.offsets[d]) + np.concatenate([[0], np.cumsum(sides[d])[:-1]])
        spans = [(int(b), int(n)) for b, n in zip(starts, sides[d], strict=True) if n]
        bits = [np.asarray(mask[b: b + n]) for b, n in spans]
        if policy == "keep_answer":
            kept = _cut_from_left([int(stream.tokens[b]) for b, _ in spans], bits, seq_len, stream.meta.get("bos_id"))
            drop[d] = kept is None
            heads[d], cuts[d] = kept or (0, 0)
        else:
            drop[d] = not all((b[:seq_len] & TRAINED).any() for b in bits)
    keep = np.flatnonzero(~drop)
    return Truncation(keep, heads[keep], cuts[keep], 0 if policy == "drop" else len(long) - int(drop.sum()),
                      int(drop.sum()))


def labels_of(ids: np.ndarray, bits: np.ndarray, labelled: int = TRAINED) -> np.ndarray:
    """A sequence's labels: the token where its mask bits have `labelled`, else -100; the first always
    -100, so in a packed block no sequence learns from the one before it."""
    labels = np.where(bits & labelled, ids, IGNORE_INDEX)
    labels[0] = IGNORE_INDEX
    return labels


FIXES = "raise train.seq_len, or set data.truncation: keep_answer (the prompt cut from the left), keep_start or drop"
"""What a sample too long under `data.truncation: error` can do instead."""


def kept_samples(stream: TokenStream, mask: np.ndarray, seq_len: int, policy: str, where: str) -> KeptSamples:
    lengths = np.diff(np.asarray(stream.offsets)).astype(np.int64)

    def too_long(long: np.ndarray) -> UserError:
        first = int(long[0])
        return UserError(f"{len(long)} sample(s) are longer than train.seq_len {seq_len}", [Problem(
            "data.truncation", f"sample {first} of {where} has {lengths[first]} tokens (and {len(long) - 1} more are too "
            "long)", FIXES)])

    cut = apply_truncation(stream, mask, lengths[:, None], seq_len, policy, too_long)
    return KeptSamples(cut.keep, np.minimum(lengths[cut.keep] - cut.cuts, seq_len), cut.heads, cut.cuts,
                       cut.truncated, cut.dropped)


class SampleView:
    """A view over a cache entry's kept samples (or records): `kept` (with `docs`, their documents)
    of `stream`, read through its loss mask. Padded, one per row of seq_len; packed, whole ones in
    `blocks`, whose capacity is a row."""

    blocks: Blocks | None = None

    def __init__(self, stream: TokenStream, mask: np.ndarray, kept: Kept, seq_len: int):
        self.stream, self.seq_len, self.kept = stream, seq_len, kept
        self._tokens, self._mask, self._offsets = stream.tokens, mask, stream.offsets
        self._pad = int(stream.meta["eos_id"])

    @property
    def samples(self) -> int:
        return len(self.kept.docs)

    @property
    def shape(self) -> tuple[int, int]:
        if self.blocks is None:
            return (self.samples, self.seq_len)
        return (len(self.blocks), self.blocks.capacity)

    def __len__(self) -> int:
        return self.shape[0]


class _Samples(SampleView):
    def __init__(self, stream: TokenStream, mask: np.ndarray, kept: KeptSamples, seq_len: int, labelled: int = TRAINED):
        super().__init__(stream, mask, kept, seq_len)
        self.labelled = labelled

    def _window(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask bits) of kept sample k as the truncation policy kept it."""
        kept = self.kept
        start, head, cut = int(self._offsets[kept.docs[k]]), int(kept.heads[k]), int(kept.cuts[k])
        length = int(kept.lengths[k]) + cut
        return (window(self._tokens, start, length, head, cut).astype(np.int64),
                window(self._mask, start, length, head, cut))

    def _sample(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, labels) of kept sample k."""
        ids, bits = self._window(k)
        return ids, labels_of(ids, bits, self.labelled)

    def prompt_and_answer(self, k: int) -> tuple[list[int], list[int]] | None:
        """Kept sample k cut before its last answer: the prompt a model answers, and the answer (None
        when the sample has no answer, or none that starts after a prompt)."""
        ids, bits = self._window(k)
        answer = (bits & ANSWER) > 0
        if not answer.any():
            return None
        ids = ids.tolist()
        last = int(np.flatnonzero(answer)[-1])
        first = last
        while first > 0 and answer[first - 1]:
            first -= 1
        return (ids[:first], ids[first: last + 1]) if first > 0 else None


class PackedSamples(_Samples):
    def __init__(self, stream: TokenStream, mask: np.ndarray, kept: KeptSamples, seq_len: int, labelled: int = TRAINED,
                 flatten: bool = False):
        super().__init__(stream, mask, kept, seq_len, labelled)
        self.blocks: Blocks = best_fit_decreasing(kept.lengths, seq_len)
        self.flatten = flatten

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
        return flattened(out) if self.flatten else out


def flattened(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A packed micro-batch as one row, as flash-attention's varlen path takes packed position ids."""
    return {k: v.reshape(1, -1) for k, v in batch.items()}


class PaddedSamples(_Samples):
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


def held_out_views(train: TokenStream, validation: TokenStream | None, config,
                   kept_of: Callable[[TokenStream, str], K], view: Callable[[TokenStream, K, bool], V]) -> tuple[V, V]:
    """(train, validation) views: validation data's (in the training data's record format), else whole
    kept samples held out of the training data by `validation_ratio`. `kept_of(stream, where)`: the
    truncation policy's; `view(stream, kept, validating)`: packed or padded."""
    kept = kept_of(train, "the training data")
    if validation is not None:
        if validation.meta.get("record_format") != train.meta.get("record_format"):
            raise UserError("the validation data is in another record format", [Problem(
                "data.validation_files", f"{validation.meta.get('record_format')} records, the training data has "
                f"{train.meta.get('record_format')}", "validate on records of the training data's format")])
        return view(train, kept, False), view(validation, kept_of(validation, "the validation data"), True)
    held = split_ids(len(kept.docs), config.data.validation_ratio, config.train.seed)
    rest = np.setdiff1d(np.arange(len(kept.docs)), held)
    return view(train, kept.subset(rest), False), view(train, kept.subset(held), True)


def sft_views(train: TokenStream, validation: TokenStream | None, config, flatten: bool) -> tuple[SftSamples, SftSamples]:
    """(train, validation) views of chat / instruction streams: the truncation policy, then whole samples
    held out by `validation_ratio` (when no validation data is given), then packed or padded."""
    seq_len, data = config.train.seq_len, config.data

    def view(stream: TokenStream, kept: KeptSamples, validating: bool) -> SftSamples:
        labelled = ANSWER if validating else TRAINED
        if data.packing:
            return PackedSamples(stream, read_mask(stream), kept, seq_len, labelled, flatten)
        return PaddedSamples(stream, read_mask(stream), kept, seq_len, labelled)

    def kept_of(stream: TokenStream, where: str) -> KeptSamples:
        return kept_samples(stream, read_mask(stream), seq_len, data.truncation, where)

    return held_out_views(train, validation, config, kept_of, view)


def summary(stream: TokenStream, tokenized: list[str], seconds: float, noun: str, split: str,
            counts: list[tuple[int, str]]) -> str:
    """The data summary of chat-path records: where they came from, what they are, `split` (the line
    on the train and validation views), the `counts` of `noun` that are not nonzero, and the cache."""
    meta = stream.meta
    how = f"tokenised {' and '.join(tokenized)} in {seconds:.1f} s" if tokenized else f"cache hit ({seconds:.2f} s)"
    template = f", chat template: {meta['template_origin']}" if meta.get("template_origin") else ""
    text = (f"data: {how}: {meta['record_format']} records, {int(meta['tokens']):,} tokens in {stream.num_documents:,} "
            f"{noun}; loss on {meta['mask_method']}{template}\n  {split}")
    notes = [f"{n:,} {what}" for n, what in counts if n]
    return text + (f"\n  {noun}: {'; '.join(notes)}" if notes else "") + f"\n  cache: {stream.directory}"


def truncation_counts(meta: dict, kept: Kept, config, untrained: str, cut_empty: str) -> list[tuple[int, str]]:
    """The summary's counts of what did not train whole: dropped when tokenised (`untrained`: why), their
    text cut at the record budget (orchestrate/data/records.py), and what `data.truncation` cut or
    dropped (keep_start: `cut_empty`, what the cut left)."""
    seq_len, policy = config.train.seq_len, config.data.truncation
    cut, dropped = {
        "keep_answer": (f"had their prompt cut from the left to fit seq_len {seq_len} (keep_answer)",
                        f"dropped: an answer that does not fit in seq_len {seq_len}"),
        "keep_start": (f"cut to their first {seq_len} tokens (keep_start)", f"dropped: {cut_empty}"),
    }.get(policy, ("", f"dropped: longer than seq_len {seq_len} ({policy})"))
    return [(meta.get("dropped_untrained", 0), f"dropped when tokenised: {untrained}"),
            (meta.get("records_cut", 0), "with text cut before tokenising (far longer than seq_len)"),
            (kept.truncated, cut), (kept.dropped, dropped)]


def describe_sft(stream: TokenStream, train: SftSamples, validation: SftSamples, config, tokenized: list[str],
                 seconds: float) -> str:
    """The data summary of chat / instruction records: format, how the loss mask was found, the samples,
    blocks and packing efficiency, and every sample truncated or dropped."""
    seq_len = config.train.seq_len
    if isinstance(train, PackedSamples):
        split = (f"{train.samples:,} train samples in {len(train):,} blocks of {seq_len} (packing efficiency "
                 f"{100 * train.blocks.efficiency:.1f} %) / {validation.samples:,} validation samples in "
                 f"{len(validation):,} blocks")
    else:
        split = f"{train.samples:,} train / {validation.samples:,} validation samples, padded to {seq_len}"
    counts = truncation_counts(stream.meta, train.kept, config, "no trained token",
                               f"nothing to train in their first {seq_len} tokens")
    return summary(stream, tokenized, seconds, "samples", split, counts)
