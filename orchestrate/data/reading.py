"""A `Source` read into `datasets.Dataset`s: one load call, or, when the files of one call differ in
their columns (JSON lines of chat beside Alpaca records, which `datasets` refuses with a CastError),
one part per run of files of the same columns, each detected on its own by the caller.

Read failures become one UserError naming the file; a dataset name that is neither on disk nor in the
`datasets` cache, on a machine that cannot reach the Hub (HF_HUB_OFFLINE=1, or no network), says so
and how to get it there, instead of the library's "not cached in None".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.data.cache import no_space
from orchestrate.data.sources import Source
from orchestrate.errors import Problem, UserError


@dataclass(frozen=True)
class Part:
    """Records of one source read by one load call (or a run of its files of the same columns)."""

    source: Source
    ds: Any
    """The `datasets.Dataset`."""


def root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def read_parts(source: Source, work: Path, num_proc: int) -> list[Part]:
    """The source's records, in file order: one part, or one per run of files of the same columns.
    `work`: scratch space for the Arrow copies of local files."""
    try:
        return [Part(source, load(source, work, num_proc))]
    except UserError:
        if source.kind != "files" or len(source.files) == 1:
            raise
    # Each file alone (the one that cannot be read is named); the files of one run of equal columns
    # then make one part again.
    import datasets

    alone = [(path, load(_one_file(source, path), work, 1)) for path in source.files]
    parts: list[Part] = []
    start = 0
    for end in range(1, len(alone) + 1):
        if end == len(alone) or alone[end][1].features != alone[start][1].features:
            run = alone[start:end]
            files = tuple(path for path, _ in run)
            ds = run[0][1] if len(run) == 1 else datasets.concatenate_datasets([d for _, d in run])
            parts.append(Part(Source("files", source.where, source.builder, files, source.options,
                                     listed=source.listed), ds))
            start = end
    return parts


def _one_file(source: Source, path: Path) -> Source:
    return Source("files", source.where, source.builder, (path,), source.options, listed=source.listed)


def load(source: Source, work: Path, num_proc: int):
    """The source as one `datasets.Dataset`; read failures become a UserError naming the file."""
    import datasets

    try:
        if source.kind == "disk":
            ds = datasets.load_from_disk(str(source.files[0]))
            if isinstance(ds, datasets.DatasetDict):
                if source.split not in ds:
                    raise UserError(f"{source.files[0]} has no split {source.split!r}", [Problem(
                        source.where, f"its splits are {sorted(ds)}", "set data.split / data.validation_split")])
                ds = ds[source.split]
            return ds
        if source.kind == "dataset":
            # Passed through unchanged. A Hub download stays in the user's ordinary HF cache (reused
            # by a later rebuild); the Arrow copy of a local directory is scratch, like files'.
            local = {"cache_dir": str(work)} if Path(source.name).exists() else {}
            return datasets.load_dataset(source.name, source.config_name, split=source.split, **local)
        # Local files become scratch Arrow first: datasets' "Generating train split" bar for that says
        # nothing our own tokenising progress does not (a Hub download above keeps its bars).
        shown = datasets.utils.logging.is_progress_bar_enabled()
        datasets.utils.logging.disable_progress_bar()
        try:
            ds = datasets.load_dataset(source.builder, data_files=[str(p) for p in source.files], split="train",
                                       cache_dir=str(work), num_proc=num_proc if len(source.files) > 1 else None,
                                       **dict(source.options))
            # The JSON reader keeps bytes that are no UTF-8 in its strings (sources.py sniffs a file's head
            # only); checked here, once per build, they are this read error instead of one inside the map.
            ds.data.validate(full=True)
            return ds
        finally:
            if shown:
                datasets.utils.logging.enable_progress_bar()
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow, json, csv, network, ...: all unreadable input
        if no_space(exc):  # the scratch Arrow copy filled the disk: the input is not to blame
            raise
        if source.kind == "dataset" and not Path(source.name).exists():
            raise _dataset_error(source, exc) from None
        raise UserError(f"cannot read {source.describe()}", [Problem(
            source.where, root_cause(exc), "check that the file is valid " + (source.builder or "data"))]) from None


def _chain(exc: BaseException | None):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _dataset_error(source: Source, exc: BaseException) -> UserError:
    """A dataset name that could not be loaded: not cached on a machine off the Hub, not on the Hub,
    or the library's own words."""
    import datasets

    name = source.name
    where = f"{source.where}.path" if source.listed is not None else source.where
    if any(isinstance(e, datasets.exceptions.DatasetNotFoundError) for e in _chain(exc)):
        return UserError(f"no dataset {name!r}", [Problem(
            where, f"{name!r} is no local path (relative to the YAML file's directory) and the Hub has no "
            f"dataset of that name that this machine may read ({root_cause(exc)})",
            "check the name or the path; a gated or private dataset needs `huggingface-cli login` first")])
    unreachable = any(isinstance(e, ConnectionError) or type(e).__name__ in ("OfflineModeIsEnabled",
                      "LocalEntryNotFoundError") for e in _chain(exc))
    if not unreachable:
        return UserError(f"cannot load the dataset {source.describe()}", [Problem(
            where, root_cause(exc), "check the dataset's name, configuration (name) and split")])
    why = ("HF_HUB_OFFLINE is set: the datasets library does not reach the Hub" if datasets.config.HF_HUB_OFFLINE
           else f"this machine cannot reach the Hub ({root_cause(exc)})")
    return UserError(f"the dataset {name!r} is not cached here and cannot be downloaded", [Problem(
        where, f"{name!r} is neither a local path nor in the datasets cache ({datasets.config.HF_DATASETS_CACHE}), "
        f"and {why}",
        f"download it where the Hub is reachable (`datasets.load_dataset({name!r}).save_to_disk(DIR)`, or "
        f"`huggingface-cli download --repo-type dataset {name} --local-dir DIR`), copy DIR here and give it as the "
        "path; or fill this machine's datasets cache (HF_DATASETS_CACHE) from one that has it; or, where this "
        "machine has network, unset HF_HUB_OFFLINE")])
