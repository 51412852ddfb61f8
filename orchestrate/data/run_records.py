"""What a run's training records were, read back after the run for `orchestrate chat`: their record
format and whether they hold lists of messages, decided as the data pipeline decided them
(records.py `detect_format`, `holds_messages`), so that chat renders a prompt the way training
rendered the records (records.py `uses_chat_template`).

`data.record_format` (or `data.template`: plain text) says the format; with `auto` it is detected from
the columns of the first record of each training source (each `data.datasets` entry with its own
settings), read by streaming it (the data is not prepared again), and the sources' formats make the
stream's as the data pipeline made it (records.py `stream_format`). Data that cannot be read any more is one error whose fix is to say it: `--template`
or `--raw`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.data.records import (
    SFT_FORMATS,
    conversational_column,
    detect_format,
    holds_messages,
    stream_format,
    uses_chat_template,
)
from orchestrate.data.sources import Source, resolve_sources
from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    from orchestrate.config.data import DataSection
    from orchestrate.config.schema import RunConfig
    from orchestrate.planner.plan import RunFiles

FORCE = "say how to render the prompt: --template (the saved chat template) or --raw (the text as it is)"


def first_record(source: Source) -> dict[str, Any]:
    """The first record of `source`, streamed (nothing prepared or copied); a UserError when it cannot
    be read or holds none."""
    import datasets

    try:
        if source.kind == "disk":
            ds = datasets.load_from_disk(str(source.files[0]))
            rows = iter(ds[source.split] if isinstance(ds, datasets.DatasetDict) else ds)
        elif source.kind == "dataset":
            rows = iter(datasets.load_dataset(source.name, source.config_name, split=source.split, streaming=True))
        else:
            rows = iter(datasets.load_dataset(source.builder, data_files=[str(p) for p in source.files], split="train",
                                              streaming=True, **dict(source.options)))
        return next(rows)
    except Exception as exc:  # noqa: BLE001 - gone, unreadable or empty data: one message, whatever the reader
        raise UserError("cannot tell how the run rendered its records", [Problem(
            source.where, f"the first record of {source.describe()} cannot be read "
            f"({type(exc).__name__}: {str(exc).strip() or 'no records'})", FORCE)]) from None


def run_record_format(config: RunConfig, plan_files: RunFiles | None, run_dir: Path,
                      own_format: str | None = None) -> tuple[str, bool]:
    """(the record format of the run's training records, whether they hold lists of messages);
    `own_format`: the format a training method's own records render as (methods/spec.py
    `Method.record_format`: GRPO's prompts), which no column tells."""
    data = config.data
    known = own_format or _named_format(data)
    if known is not None and conversational_column(known, data) is None and not data.datasets:
        return known, False
    try:
        sources = resolve_sources(config, plan_files, run_dir)
    except UserError as exc:
        raise UserError("cannot tell how the run rendered its records", [*exc.problems, Problem(
            "RUN_DIR", "the run's training data cannot be found", FORCE)]) from None
    found = [_source_format(source, data.for_source(source.listed), own_format) for source in sources.train]
    formats = [f for f, _ in found]
    templated = any(f in SFT_FORMATS and uses_chat_template(f, data.chat_template is not None, m) for f, m in found)
    record_format = stream_format(formats, templated) or formats[0]
    return record_format, any(m for f, m in found if f == record_format)


def _named_format(data: DataSection) -> str | None:
    """The format the section names (record_format, or a template: text); None for auto."""
    return detect_format((), data) if data.record_format != "auto" or data.template is not None else None


def _source_format(source: Source, data: DataSection, own_format: str | None) -> tuple[str, bool]:
    """(one source's record format, whether its records hold lists of messages)."""
    known = own_format or _named_format(data)
    if known is not None and conversational_column(known, data) is None:
        return known, False
    record = first_record(source)
    record_format = known or detect_format(record, data)
    return record_format, holds_messages(record, record_format, data)
