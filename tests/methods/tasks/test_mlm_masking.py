"""Masked-LM masking (orchestrate/data/mlm.py): draw for draw the same as transformers'
`DataCollatorForLanguageModeling` given the same generator, the 80/10/10 rule in the statistics, and
the same masks after a resume as in the uninterrupted stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orchestrate.data.blocks import IGNORE_INDEX
from orchestrate.data.mlm import MLMMasker
from orchestrate.data.pipeline import TrainData
from orchestrate.data.sampler import DistributedBlockSampler

WORDS = [f"w{i}" for i in range(60)]
PAD, EOS, MASK = 0, 1, 2


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": PAD, "<eos>": EOS, "[MASK]": MASK, "[UNK]": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", eos_token="<eos>",
                                   mask_token="[MASK]", unk_token="[UNK]")


def _batch(rows: int, length: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Padded documents as orchestrate makes them: tokens, <eos>, then padding (attention 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, length), generator=g)
    lengths = torch.randint(length // 4, length, (rows,), generator=g)
    attention = (torch.arange(length)[None, :] <= lengths[:, None]).long()
    ids[torch.arange(rows), lengths] = EOS
    ids[attention == 0] = PAD
    return {"input_ids": ids, "attention_mask": attention}


def test_masking_is_the_collators_draw_for_draw():
    from transformers import DataCollatorForLanguageModeling

    tok = _tokenizer()
    batch = _batch(32, 96, len(tok), seed=0)
    masker = MLMMasker(MASK, len(tok), EOS, seed=7)
    ours = masker(batch, (0, 0, 5, 1))
    collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15)  # 80/10/10 are its defaults
    collator.generator = masker.generator((0, 0, 5, 1))  # the same draws from the same state
    special = (batch["attention_mask"] == 0) | (batch["input_ids"] == EOS)
    inputs, labels = collator.torch_mask_tokens(batch["input_ids"].clone(), special_tokens_mask=special)
    assert (labels != IGNORE_INDEX).sum() > 300  # enough masked positions for the comparison to mean something
    assert torch.equal(ours["labels"], labels)
    assert torch.equal(ours["input_ids"], inputs)
    assert torch.equal(ours["attention_mask"], batch["attention_mask"])


def test_the_80_10_10_rule_holds_in_the_statistics():
    vocab = 1000  # random replacements rarely draw the original token (1 in 1000)
    batch = _batch(1024, 128, vocab, seed=1)
    ids, labels = batch["input_ids"], MLMMasker(MASK, vocab, EOS, seed=3)(batch, (0, 0, 0, 0))
    out, lab = labels["input_ids"], labels["labels"]
    eligible = (batch["attention_mask"] == 1) & (ids != EOS)
    chosen = lab != IGNORE_INDEX
    assert not (chosen & ~eligible).any(), "padding or <eos> was masked"
    assert torch.equal(lab[chosen], ids[chosen])  # labels are the original tokens
    assert not (out[~chosen] != ids[~chosen]).any(), "a token that is not predicted was changed"
    n = chosen.sum().item()
    rate = n / eligible.sum().item()
    masked = (out[chosen] == MASK).float().mean().item()
    kept = (out[chosen] == ids[chosen]).float().mean().item()
    replaced = 1 - masked - kept
    # ~12,000 chosen of ~82,000 eligible tokens: binomial standard errors ~0.0012 (rate), ~0.0036
    # ([MASK] share) and ~0.0027 (the 10 % shares); the bounds are about 4 of them.
    print(f"chosen {rate:.4f}, [MASK] {masked:.4f}, random {replaced:.4f}, kept {kept:.4f} of {n}")
    assert rate == pytest.approx(0.15, abs=0.006)
    assert masked == pytest.approx(0.80, abs=0.015)
    assert replaced == pytest.approx(0.10, abs=0.011)
    assert kept == pytest.approx(0.10, abs=0.011)


class _Documents:
    """A stand-in for PaddedDocuments: document i is a fixed padded row derived from i."""

    def __init__(self, count: int, length: int):
        self.data = _batch(count, length, 500, seed=2)

    def __len__(self) -> int:
        return len(self.data["input_ids"])

    def batch(self, positions: list[int]) -> dict[str, torch.Tensor]:
        return {k: v[positions].clone() for k, v in self.data.items()}


def _data(rank: int) -> TrainData:
    docs = _Documents(40, 48)
    return TrainData(tokenizer=None, train=docs, validation=docs,
                     sampler=DistributedBlockSampler(len(docs), rank, 2, seed=11),
                     masker=MLMMasker(MASK, 500, EOS, seed=11))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_resumed_stream_masks_exactly_as_the_uninterrupted_one(rank):
    """Steps 1-30 (past an epoch boundary: 40 documents, 2 ranks x 2 per step) uninterrupted, and
    steps 1-13, a checkpoint of the sampler, a fresh process state restoring it, steps 14-30."""
    whole = _data(rank)
    expected = [whole.micro_batch(2) for _ in range(30)]
    first = _data(rank)
    got = [first.micro_batch(2) for _ in range(13)]
    state = first.sampler.state_dict()
    resumed = _data(rank)
    resumed.sampler.load_state_dict(state)
    got += [resumed.micro_batch(2) for _ in range(17)]
    for step, (a, b) in enumerate(zip(got, expected, strict=True), 1):
        assert all(torch.equal(a[k], b[k]) for k in b), f"step {step} differs after the resume"
    assert np.mean([(b["labels"] != IGNORE_INDEX).float().mean().item() for b in expected]) > 0.05
