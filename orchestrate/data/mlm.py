"""Masked-LM inputs: 15 % of the real tokens are chosen; of those 80 % become the mask id, 10 % a
random token and 10 % stay; labels are -100 everywhere else. The same draws, in the same order from
one torch.Generator, as transformers' `DataCollatorForLanguageModeling.torch_mask_tokens`
(mlm_probability=0.15, mask_replace_prob=0.8, random_replace_prob=0.1), and checked against it.

Deterministic and resumable: the generator of a training micro-batch is seeded from (train.seed,
the sampler's place in the stream, rank), which a checkpoint stores; evaluation batches get fixed
seeds, so eval losses are comparable across steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from orchestrate.data.blocks import IGNORE_INDEX
from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    import torch

MLM_PROBABILITY, MASK_REPLACE, RANDOM_REPLACE = 0.15, 0.8, 0.1


def mask_token_id(tokenizer, model_vocab: int) -> int:
    """The tokenizer's mask token, or for the built-in byte tokenizer the first id after its EOS
    (the model's vocabulary must have room for it)."""
    hf = getattr(tokenizer, "tok", None)
    if hf is not None and getattr(hf, "mask_token_id", None) is not None:
        return int(hf.mask_token_id)
    if hf is None and tokenizer.vocab_size < model_vocab:
        return tokenizer.vocab_size
    raise UserError("masked-lm needs a mask token", [Problem(
        "data.tokenizer", "the tokenizer has no mask token" if hf is not None else
        f"the byte tokenizer's mask id {tokenizer.vocab_size} is outside the model's vocab_size {model_vocab}",
        "use a tokenizer with a [MASK] token" if hf is not None else
        f"set the model's vocab_size to at least {tokenizer.vocab_size + 1}")])


class MLMMasker:
    def __init__(self, mask_id: int, vocab_size: int, eos_id: int, seed: int):
        self.mask_id, self.vocab_size, self.eos_id, self.seed = mask_id, vocab_size, eos_id, seed

    def generator(self, key: tuple[int, ...]) -> torch.Generator:
        import torch

        state = np.random.SeedSequence([self.seed % 2**64, *key]).generate_state(1, np.uint64)[0]
        return torch.Generator().manual_seed(int(state % 2**63))

    def __call__(self, batch: dict[str, torch.Tensor], key: tuple[int, ...]) -> dict[str, torch.Tensor]:
        import torch

        g = self.generator(key)
        inputs = batch["input_ids"].clone()
        labels = inputs.clone()
        # Never masked: padding and the end-of-document token (the collator's special_tokens_mask).
        special = (batch["attention_mask"] == 0) | (inputs == self.eos_id)
        probability = torch.full(labels.shape, MLM_PROBABILITY).masked_fill_(special, 0.0)
        masked = torch.bernoulli(probability, generator=g).bool()
        labels[~masked] = IGNORE_INDEX
        replaced = torch.bernoulli(torch.full(labels.shape, MASK_REPLACE), generator=g).bool() & masked
        inputs[replaced] = self.mask_id
        scaled = RANDOM_REPLACE / (1 - MASK_REPLACE)
        random = torch.bernoulli(torch.full(labels.shape, scaled), generator=g).bool() & masked & ~replaced
        words = torch.randint(self.vocab_size, labels.shape, dtype=torch.long, generator=g)
        inputs[random] = words[random]
        return {**batch, "input_ids": inputs, "labels": labels}
