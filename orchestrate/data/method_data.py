"""A training method's part of the data path, as values: data/ names no method. The layer that knows
the run's methods (orchestrate/methods/registry.py `method_data`, called by the launcher, the worker
and `orchestrate prepare`) hands them to the pipeline's entry points (orchestrate/data/pipeline.py).

- `RecordReader`: records of the method's own read on the chat path (preference pairs): it turns
  one record into a cached document (ids and mask.bin bits), views the cached documents as samples,
  checks that the run trains on such records, and describes them.
- `OwnData`: data the method brings itself instead of the token pipeline (your dataset factory),
  checked and described on the launcher, each rank's TrainData made on the worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrate.data.records import PREFERENCE_FORMATS
from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    import numpy as np

    from orchestrate.config.data import DataSection
    from orchestrate.config.schema import RunConfig
    from orchestrate.data.cache import TokenStream
    from orchestrate.data.chat_template import ChatTemplate
    from orchestrate.data.tokenizer import Tokenizer
    from orchestrate.planner.plan import RunPlan

    Document = tuple[list[int], np.ndarray]
    """A record's ids and its mask.bin bits (orchestrate/data/sft_prepare.py)."""


@dataclass(frozen=True)
class RecordReader:
    """Records of a method's own on the chat path, bound to the run's config."""

    formats: tuple[str, ...]
    """The record formats it reads (detected by orchestrate/data/records.py)."""
    check: Callable[[str, str], None]
    """(record_format, where): UserError unless the run's method trains on records of that format."""
    tokens: Callable[[dict, str, DataSection, ChatTemplate | None, Tokenizer], tuple[Document | None, str | None]]
    """(record, record_format, data section, template, tokenizer) -> (its document, None), (None, None)
    when it trains nothing, or (None, what is wrong with it)."""
    views: Callable[[TokenStream, TokenStream | None, RunConfig, bool], tuple[Any, Any]]
    """(train, validation streams, config, flatten) -> (train, validation) samples (`SampleView`s)."""
    describe: Callable[[TokenStream, Any, Any, RunConfig, list[str], float], str]
    """(train stream, train, validation samples, config, streams tokenised, seconds) -> the data summary."""


@dataclass(frozen=True)
class OwnData:
    """Data a method brings itself (the token pipeline is not used)."""

    check: Callable[[RunConfig], None]
    """The launcher's cheap check of the data section (UserError)."""
    describe: Callable[[RunConfig], str]
    """The launcher's data summary line."""
    train_data: Callable[[RunPlan, int, int], Any]
    """(plan, rank, world size) -> the worker's data for this rank (the pipeline's `TrainData`)."""


@dataclass(frozen=True)
class MethodData:
    """What the run's methods bring to the data path (none by default: text, chat and instruction
    records through the token pipeline)."""

    readers: tuple[RecordReader, ...] = ()
    own: OwnData | None = None

    def reader(self, record_format: str) -> RecordReader | None:
        """The reader of records of `record_format`; None: the chat path's own (or plain text)."""
        return next((r for r in self.readers if record_format in r.formats), None)

    def check_records(self, record_format: str, where: str) -> None:
        """The methods' checks of the run's records (`where` names them), and preference records
        refused where no method trains on them."""
        for reader in self.readers:
            reader.check(record_format, where)
        if record_format in PREFERENCE_FORMATS and self.reader(record_format) is None:
            raise UserError("the records are preference records", [Problem(
                where, f"{record_format} records (chosen / rejected answers, or answers with a label) train "
                "with a preference loss", "add a `preference:` section (docs/preference.md), or set "
                "data.record_format to the format you mean (e.g. prompt-completion)")])


NO_METHOD_DATA = MethodData()
"""No method brings anything: text, chat and instruction records through the token pipeline."""
