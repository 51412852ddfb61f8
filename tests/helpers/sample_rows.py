"""A prepared run's training samples as readable rows, for label-mask tests: each token named (the
word tokenizer's tokens, or the byte tokenizer's characters and EOS) beside the token its label trains
on (None where the label is ignored)."""

from __future__ import annotations

from pathlib import Path

from orchestrate.data.blocks import IGNORE_INDEX
from orchestrate.data.pipeline import prepare_data, samples_for

BYTE_EOS = 256


def sample_rows(config, root: Path, validation: bool = False) -> list[tuple[list[str], list[str | None]]]:
    """Every training (or validation: labels it evaluates) sample of `config` as (tokens, labels), in the
    stream's order; a word tokenizer is read from root/tok when the config names one."""
    view = samples_for(prepare_data(config), config)[1 if validation else 0]
    if config.data.tokenizer:
        from transformers import AutoTokenizer

        name = AutoTokenizer.from_pretrained(root / "tok").convert_ids_to_tokens
    else:
        def name(i: int) -> str:
            return "EOS" if i == BYTE_EOS else chr(i)
    out = []
    for k in range(len(view)):
        batch = view.batch([k])
        n = int(batch["attention_mask"][0].sum())
        ids, labels = batch["input_ids"][0, :n].tolist(), batch["labels"][0, :n].tolist()
        out.append(([name(i) for i in ids], [None if x == IGNORE_INDEX else name(x) for x in labels]))
    return out
