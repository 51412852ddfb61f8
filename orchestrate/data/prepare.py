"""Tokenise sources once: `datasets` loads them, `Dataset.map` tokenises in `num_proc` processes,
and the ids are written as one flat stream into a cache entry (`cache.py`).

`ensure_stream` is the one entry point: it opens the entry for the sources' fingerprint if it exists
and otherwise builds it (or, on ranks that must not build, waits for the rank that does).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orchestrate.data.cache import (
    CACHE_FORMAT,
    META_FILE,
    OFFSETS_FILE,
    TOKENS_FILE,
    TokenStream,
    disk_full,
    entry_key,
    entry_mismatch,
    entry_name,
    no_space,
    open_entry,
    publish,
    refuse_links,
    temp_dir_for,
    temp_dir_name,
)
from orchestrate.data.checks import check_num_proc, cpu_cores, ensure_cache_dir
from orchestrate.data.doc_labels import write_labels
from orchestrate.data.mixing import Mix
from orchestrate.data.reading import Part, read_parts
from orchestrate.data.records import expected_shapes
from orchestrate.data.sft_prepare import (
    MASK_FILE,
    Rendering,
    SftSettings,
    is_sft,
    raise_nothing_trainable,
    raise_record_problems,
    render_parts,
    sft_meta,
    tokenize_records,
)
from orchestrate.data.sources import Source, source_identity, total_bytes
from orchestrate.data.text_template import render, template_fields
from orchestrate.data.tokenizer import Tokenizer, token_dtype
from orchestrate.errors import Problem, UserError

_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
AUTO_PARALLEL_BYTES = 64 * 2**20
"""num_proc "auto" tokenises in parallel only above this much input: below, process start-up costs more."""
_MAP_BATCH = 1000


@dataclass(frozen=True)
class TextSpec:
    """How a record becomes a document."""

    text_field: str = "text"
    template: str | None = None
    label_field: str | None = None
    """The label column of a classifier's data (None: no labels)."""

    sft: SftSettings | None = None
    """Causal LM: how chat and instruction records become samples (None: plain text only)."""

    mix: Mix | None = None
    """`data.datasets`: how many records of each source the stream takes (mixing.py)."""

    def fields(self) -> list[str]:
        return [self.text_field] if self.template is None else template_fields(self.template)

    def identity(self) -> dict:
        identity = {"text_field": self.text_field if self.template is None else None, "template": self.template}
        if self.label_field is not None:  # absent otherwise: unlabelled cache keys stay what they were
            identity["label_field"] = self.label_field
        if self.sft is not None:
            identity["sft"] = self.sft.identity()
        if self.mix is not None:
            identity["mix"] = self.mix.identity()
        return identity


@dataclass
class StreamResult:
    stream: TokenStream
    built: bool
    """True when this call tokenised (a cache miss), False for a cache hit."""


def stream_identity(sources: list[Source], spec: TextSpec, tokenizer: Tokenizer) -> dict:
    return {"sources": [source_identity(s) for s in sources], "text": spec.identity(),
            "tokenizer": tokenizer.fingerprint()}


def ensure_stream(sources: list[Source], spec: TextSpec, tokenizer: Tokenizer, cache_dir: Path, *,
                  num_proc: int | str = "auto", progress: bool = False, force: bool = False,
                  may_build: bool = True, poll_s: float = 1.0) -> StreamResult:
    """The cache entry of `sources` tokenised by `tokenizer`, built if missing (or if `force`).
    Ranks with `may_build` False wait for the entry instead (another local rank builds it). An entry
    whose meta.json is another key's is a miss, rebuilt with a line saying so (`entry_mismatch`); a
    link in the cache entry is refused (`refuse_links`); a full disk is one message (`disk_full`)."""
    key = entry_key(stream_identity(sources, spec, tokenizer))
    entry = cache_dir / entry_name(_label(sources), key)
    failed = cache_dir / f".failed-{entry.name}"
    described = [s.describe() for s in sources]
    refuse_links(entry)
    stale = entry_mismatch(entry, key, described) if (entry / META_FILE).is_file() else None
    if (entry / META_FILE).is_file() and stale is None and not force:
        return StreamResult(open_entry(entry), built=False)
    if not may_build:
        _wait_for(entry, key, described, failed, poll_s)
        return StreamResult(open_entry(entry), built=False)
    if stale is not None:
        print(f"data cache entry {entry} does not belong to these sources: {stale}; tokenising again",
              file=sys.stderr, flush=True)
    ensure_cache_dir(cache_dir)
    tmp = temp_dir_name(entry)
    try:
        temp_dir_for(entry)
        _build(sources, spec, tokenizer, tmp, key, _num_proc(num_proc, sources), progress)
        publish(tmp, entry, replace=force or stale is not None)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # first: on a full disk, the space the marker below needs
        error = disk_full(cache_dir, f"the entry {entry.name}", total_bytes(sources)) if no_space(exc) else exc
        # Tell the waiting ranks of this attempt, which would otherwise wait forever: a rank that
        # got SIGTERM only sets a flag (orchestrate/worker/signals.py) and keeps waiting.
        message = error.headline if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
        try:
            failed.write_text(json.dumps({"attempt": _attempt(), "error": message}))
        except OSError:
            pass  # a disk too full for the marker: the waiting ranks see the same full disk
        if error is exc:
            raise
        raise error from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a successful rename; left-overs of a failure
    failed.unlink(missing_ok=True)
    return StreamResult(open_entry(entry), built=True)


def _attempt() -> str:
    """Names one start of the worker group on this node (torchrun's run id and restart count): a
    failure marker left by an earlier attempt is not this attempt's."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '')}"


def _wait_for(entry: Path, key: str, described: list[str], failed: Path, poll_s: float) -> None:
    """Until the entry of `key` is in place (one that is another key's is being rebuilt by local rank 0)."""
    while not (entry / META_FILE).is_file() or entry_mismatch(entry, key, described) is not None:
        try:
            marker = json.loads(failed.read_text())
        except (OSError, ValueError):
            marker = None
        if marker and marker.get("attempt") == _attempt():
            raise UserError("the data could not be prepared", [Problem(
                "data", f"local rank 0 failed: {marker.get('error')}", "see local rank 0's error above")])
        time.sleep(poll_s)
    refuse_links(entry)


def _label(sources: list[Source]) -> str:
    first = sources[0]
    if first.where == "data.generate_demo_corpus":  # one name whichever copy of the corpus is read
        return "demo_corpus"
    if first.kind == "dataset":
        return first.name.rstrip("/").split("/")[-1] + f"-{first.split}"
    return first.files[0].name.split(".")[0]


def _num_proc(setting: int | str, sources: list[Source]) -> int:
    if isinstance(setting, int):
        return check_num_proc(setting)
    cores = cpu_cores()
    size = total_bytes(sources)
    return cores if size is None or size > AUTO_PARALLEL_BYTES else 1


@contextmanager
def progress_bars(enabled: bool):
    """`datasets`' progress bars on or off for the duration (restored after)."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    (datasets.enable_progress_bars if enabled else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.enable_progress_bars if was else datasets.disable_progress_bars)()


def _check_columns(ds, source: Source, spec: TextSpec, detected: SftSettings | None = None) -> None:
    """The text columns of plain-text records (`detected`: the settings of records whose format was
    detected as text for want of another shape: a missing text column is then a shape of none)."""
    import datasets

    columns = ds.column_names
    where = "data.template" if spec.template is not None else "data.text_field"
    missing = [f for f in spec.fields() if f not in columns]
    if missing and detected is not None and detected.data.record_format == "auto" and spec.template is None:
        raise UserError(f"{source.describe()} holds records of no known shape", [Problem(
            source.where, f"{source.describe()} has the columns {columns}, none of the shapes records may have "
            f"({expected_shapes(detected.data)})", "name its columns in data.columns (or in this source's columns "
            "under data.datasets), point data.text_field at its column of plain text, or set the record_format")])
    if missing:
        fix = ("set data.template to use the columns above" if spec.template is not None else
               f"set data.text_field to the column that holds the text (one of {columns})")
        raise UserError(f"{source.describe()} has no field {missing[0]!r}", [Problem(
            where, f"{source.describe()} has no column {', '.join(map(repr, missing))} (it has: {columns})", fix)])
    if spec.label_field is not None and spec.label_field not in columns:
        raise UserError(f"{source.describe()} has no label column {spec.label_field!r}", [Problem(
            "data.label_field", f"{source.describe()} has no column {spec.label_field!r} (it has: {columns})",
            f"set data.label_field to the column that holds the labels (one of {columns})")])
    if spec.label_field is not None:
        _check_labels(ds, source, spec.label_field)
    not_text = [(f, ds.features[f]) for f in spec.fields()
                if not (isinstance(ds.features[f], datasets.Value) and ds.features[f].dtype in ("string", "large_string", "null"))]
    if not_text:
        name, feature = not_text[0]
        chat = "chat records (data.record_format auto detects a messages list)"
        fix = (f"name only text columns in data.template, or drop it for {chat}" if spec.template is not None else
               f"point data.text_field at a string column, or drop it for {chat}")
        raise UserError(f"{source.describe()}: field {name!r} is not text", [Problem(
            where, f"column {name!r} of {source.describe()} holds {feature}", fix)])


def _check_labels(ds, source: Source, label_field: str) -> None:
    """Every record has a label: a missing one (an empty CSV cell, a JSON null, NaN) or a blank string
    is refused, naming the rows, rather than trained as one more class ("None", "nan")."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = ds.data.column(label_field)
    missing = pc.is_null(column, nan_is_null=True)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        # Kleene or: a null label stays missing (`or_` would make it null, read back as not missing)
        missing = pc.or_kleene(missing, pc.equal(pc.utf8_trim_whitespace(column), ""))
    rows = np.flatnonzero(missing.to_numpy(zero_copy_only=False).astype(bool))
    if len(rows):
        listed = ", ".join(str(r + 1) for r in rows[:10]) + (" ..." if len(rows) > 10 else "")
        raise UserError(f"{source.describe()} has records without a label", [Problem(
            source.where, f"{len(rows)} of {len(column)} records of {source.describe()} have no "
            f"{label_field!r}: record(s) {listed} (counting from 1, in file order, a header not counted)",
            f"give every record a label in column {label_field!r}, or remove those records")])


def documents(batch: dict, spec: TextSpec, paragraphs: bool, keep_blank: bool = False) -> list[str]:
    """The documents of a batch of records: one per record (blank ones skipped), or one per
    paragraph when `paragraphs` (blank-line separated, lines of spaces included: datasets' text
    builder splits on "\\n\\n" only)."""
    if spec.template is not None:
        rows = len(next(iter(batch.values())))
        texts = [render(spec.template, {k: v[i] for k, v in batch.items()}) for i in range(rows)]
    else:
        texts = batch[spec.text_field]
    docs: list[str] = []
    for text in texts:
        if keep_blank:  # one entry per record, "" for a blank one (labelled data keeps rows aligned)
            docs.append(text if text and text.strip() else "")
            continue
        if not text:
            continue
        if paragraphs:
            docs.extend(p.strip() for p in _PARAGRAPH_BREAK.split(text) if p.strip())
        elif text.strip():
            docs.append(text)
    return docs


def tokenize_batch(batch: dict, *, tokenizer: Tokenizer, spec: TextSpec, paragraphs: bool, dtype: str) -> dict:
    """`Dataset.map` function: records -> documents -> ids, each document followed by EOS (and, for
    labelled data, each record's label as text: one document per record, blank ones dropped with it)."""
    labels = None
    if spec.label_field is not None:
        pairs = [(doc, label) for doc, label in zip(documents(batch, spec, False, keep_blank=True),
                                                    batch[spec.label_field], strict=True) if doc]
        docs, labels = [d for d, _ in pairs], [str(label) for _, label in pairs]
    else:
        docs = documents(batch, spec, paragraphs)
    out = []
    for ids in tokenizer.encode_batch(docs) if docs else []:
        row = np.empty(len(ids) + 1, dtype=dtype)
        row[:-1] = ids
        row[-1] = tokenizer.eos_id
        out.append(row)
    return {"input_ids": out} if labels is None else {"input_ids": out, "label": labels}


def iter_documents(sources: list[Source], spec: TextSpec, work: Path, batch_size: int = _MAP_BATCH):
    """Batches of documents of every source, read as `ensure_stream` reads them (for tokenizer training)."""
    for source in sources:
        for part in read_parts(source, work, 1):
            source_spec, paragraphs = _spec_for(part.source, spec)
            _check_columns(part.ds, part.source, source_spec)
            for batch in part.ds.iter(batch_size=batch_size):
                yield documents(batch, source_spec, paragraphs)


def _spec_for(source: Source, spec: TextSpec) -> tuple[TextSpec, bool]:
    # The text builder's one column is "text", whatever text_field says about the other files.
    source_spec = TextSpec("text", spec.template, spec.label_field) if source.builder == "text" else spec
    paragraphs = source.kind == "files" and dict(source.options).get("sample_by") == "paragraph"
    return source_spec, paragraphs


def _renderings(parts: list[Part], spec: TextSpec, tokenizer: Tokenizer) -> tuple[str, list[Rendering]]:
    """The stream's record format and each part's rendering (sft_prepare.py `render_parts`), every
    part's columns checked before any is tokenised."""
    if spec.sft is None:
        record_format, renderings = "text", [Rendering("text")] * len(parts)
    else:
        record_format, renderings = render_parts(parts, spec.sft, tokenizer)
    for part, rendering in zip(parts, renderings, strict=True):
        if not is_sft(rendering.record_format):
            _check_columns(part.ds, part.source, _spec_for(part.source, spec)[0], rendering.settings)
    return record_format, renderings


def _chosen(parts: list[Part], renderings: list[Rendering], mix: Mix | None) -> tuple[list, list[dict] | None]:
    """The rows of each part the mix takes (None: all) and meta.json's account of the mix."""
    listed = [part.source.listed for part in parts]
    if mix is None or None in listed:  # validation files, or no data.datasets: every record
        return [None] * len(parts), None
    rows, sizes = mix.rows(listed, [len(part.ds) for part in parts])
    empty = next((i for i, size in enumerate(sizes) if size == 0), None)
    if empty is not None:
        raise UserError("a source holds no records", [Problem(
            f"data.datasets[{empty}]", f"{mix.labels[empty]} holds no records", "fill it or remove it from the list")])
    formats: list[list[str]] = [[] for _ in mix.labels]  # an entry's parts may differ (files of other columns)
    for entry, rendering in zip(listed, renderings, strict=True):
        if rendering.record_format not in formats[entry]:
            formats[entry].append(rendering.record_format)
    return rows, mix.account(sizes, [" + ".join(f) for f in formats])


def _mapped(ds, source: Source, rendering: Rendering, spec: TextSpec, tokenizer: Tokenizer, work: Path, key: str,
            i: int, num_proc: int, dtype: str) -> tuple[object, dict]:
    """The part's records tokenised by `Dataset.map`, and what the format says about them (for meta.json)."""
    source_spec, paragraphs = _spec_for(source, spec)
    record_format, template = rendering.record_format, rendering.template
    info: dict = {"record_format": record_format}
    if is_sft(record_format):
        fn = functools.partial(tokenize_records, tokenizer=tokenizer, settings=rendering.settings,
                               record_format=record_format, template=template, dtype=dtype)
        info.update(template=template, mask_method=rendering.settings.mask_method(template, record_format),
                    records=len(ds))
    else:
        fn = functools.partial(tokenize_batch, tokenizer=tokenizer, spec=source_spec, paragraphs=paragraphs, dtype=dtype)
    mapped = ds.map(fn, batched=True, batch_size=_MAP_BATCH, remove_columns=ds.column_names,
                    with_indices=is_sft(record_format),
                    num_proc=num_proc if num_proc > 1 and len(ds) > _MAP_BATCH else None,
                    cache_file_name=str(work / "map" / f"{i}.arrow"), new_fingerprint=f"{key}-{i}",
                    load_from_cache_file=False, desc=f"tokenising {source.describe()}")
    if is_sft(record_format):
        raise_record_problems([p for p in mapped["problem"] if p], source, record_format, info["template"])
    return mapped, info


def _build(sources: list[Source], spec: TextSpec, tokenizer: Tokenizer, work: Path, key: str,
           num_proc: int, progress: bool) -> None:
    import pyarrow.compute as pc
    from tqdm.auto import tqdm

    start = time.perf_counter()
    dtype = token_dtype(tokenizer.vocab_size)
    n_tokens, n_docs, dropped, cut = 0, 0, 0, 0
    labels: list[str] = []
    infos: list[dict] = []
    with progress_bars(progress), open(work / TOKENS_FILE, "wb") as tok_f, open(work / OFFSETS_FILE, "wb") as off_f, \
            open(work / MASK_FILE, "wb") as mask_f:
        np.zeros(1, np.int64).tofile(off_f)
        # Every source is read before any is tokenised: the mix needs their sizes, and the stream one
        # record format that their formats decide together (their scratch copies stay until the end).
        parts = [part for source in sources for part in read_parts(source, work / "hf", num_proc)]
        record_format, renderings = _renderings(parts, spec, tokenizer)
        chosen, mix = _chosen(parts, renderings, spec.mix)
        for i, (part, rendering, rows) in enumerate(zip(parts, renderings, chosen, strict=True)):
            ds = part.ds if rows is None else part.ds.select(rows)
            mapped, info = _mapped(ds, part.source, rendering, spec, tokenizer, work, key, i, num_proc, dtype.name)
            infos.append(info)
            bar = tqdm(total=len(mapped), desc="writing tokens", unit="doc", disable=not progress)
            for table in mapped.with_format("arrow").iter(batch_size=16 * _MAP_BATCH):
                bar.update(table.num_rows)
                if spec.label_field is not None:
                    labels.extend(table.column("label").to_pylist())
                if "mask" in table.column_names:  # a record that trains nothing is left out (and counted)
                    cut += int(pc.sum(table.column("cut")).as_py() or 0)
                    keep = pc.greater(pc.list_value_length(table.column("input_ids")), 0)
                    dropped += table.num_rows - int(pc.sum(keep).as_py() or 0)
                    table = table.filter(keep)
                    for chunk in table.column("mask").chunks:
                        chunk.flatten().to_numpy(zero_copy_only=False).astype(np.uint8).tofile(mask_f)
                for chunk in table.column("input_ids").chunks:
                    lengths = pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64)
                    chunk.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False).tofile(tok_f)
                    (n_tokens + np.cumsum(lengths)).tofile(off_f)
                    n_tokens += int(lengths.sum())
                    n_docs += len(lengths)
            bar.close()
            del ds, mapped
            shutil.rmtree(work / "map", ignore_errors=True)
        del parts
        shutil.rmtree(work / "hf", ignore_errors=True)
    records = sft_meta(record_format, infos, dropped, cut, getattr(getattr(tokenizer, "tok", None), "bos_token_id", None))
    if not is_sft(records["record_format"]):
        (work / MASK_FILE).unlink()
    if n_docs == 0 and is_sft(records["record_format"]):
        raise_nothing_trainable(sources[0], records["record_format"], infos[0]["template"], records["mask_method"])
    if n_docs == 0:
        names = "; ".join(s.describe() for s in sources)
        field = f"template {spec.template!r}" if spec.template is not None else f"field {spec.text_field!r}"
        raise UserError("the training data is empty", [Problem(
            sources[0].where, f"{names}: no non-blank text in {field}", "check the files and data.text_field")])
    meta = {"format": CACHE_FORMAT, "key": key, "tokens": n_tokens, "documents": n_docs, "dtype": dtype.name,
            "eos_id": tokenizer.eos_id, "vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.fingerprint(),
            "sources": [s.describe() for s in sources], "text": spec.identity(), "num_proc": num_proc,
            "prepare_seconds": round(time.perf_counter() - start, 3), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **records, **({"mix": mix} if mix is not None else {})}
    if spec.label_field is not None:
        meta["label_names"] = write_labels(work, labels)
    (work / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
