"""Which data a run trains on, as a checkpoint records it (in the sampler's state) and a resume checks it.

The training and validation streams are named by their cache entries, whose keys fingerprint the
sources' contents (orchestrate/data/sources.py: small files hashed, large ones by path, size and
modification time), the text settings and the tokenizer; then how the entries are cut into samples.
A file edited in place gets a new entry, so a resume notices it even when the block count is the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig
    from orchestrate.data.cache import TokenStream

_PARTS = {"train": "the training data (its contents, text settings or tokenizer)",
          "validation": "the validation data (its contents, text settings or tokenizer)",
          "samples": "how documents become samples (data.packing, model.task)",
          "split": "the validation split (data.validation_ratio, train.seed)"}


def data_identity(config: RunConfig, train: TokenStream, validation: TokenStream | None) -> dict[str, Any]:
    """JSON-able: the cache entry names and the sampling settings that decide what sample i is."""
    samples = ("labelled" if config.model.task == "sequence-classification" else
               "packed" if config.data.packing else "padded")
    split = None if validation is not None else {"ratio": config.data.validation_ratio, "seed": config.train.seed}
    return {"train": train.directory.name, "validation": validation.directory.name if validation else None,
            "samples": samples, "split": split}


def check_same_data(trained_on: dict[str, Any], now: dict[str, Any], checkpoint: str) -> None:
    """UserError naming each part of the data that differs from what `checkpoint` trained on: its
    data position (the sampler state) would point into other samples."""
    problems = [Problem("data", f"{what} differs from what {checkpoint} trained on "
                        f"({part}: {trained_on.get(part)} then, {now.get(part)} now)",
                        "resume with the data the run trained on, or start a new run on this data "
                        "(without --resume)")
                for part, what in _PARTS.items() if part in trained_on and trained_on[part] != now.get(part)]
    if problems:
        raise UserError("the data changed since the checkpoint", problems)
