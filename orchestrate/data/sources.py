"""What to read: the data section's files, directories, globs or dataset name (or each entry of
`data.datasets`), resolved into `Source`s (one `datasets.load_dataset` / `load_from_disk` call each),
and their fingerprint.

The fingerprint identifies the *content* cheaply: files up to `HASH_CONTENT_BYTES` are hashed (so a
generated demo corpus written into every new run directory is still the same data), larger ones are
identified by absolute path, size and modification time (hashing terabytes at every start-up is not
an option). A Hub dataset is identified by its name, config and split.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    from orchestrate.planner.plan import RunFiles

HASH_CONTENT_BYTES = 16 * 2**20
"""Files up to this size are identified by a content hash, larger ones by path, size and mtime."""

_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")
_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".ndjson": "json",
             ".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow"}
_GLOB_CHARS = set("*?[")
_DISK_MARKERS = ("state.json", "dataset_dict.json")
"""A directory holding one of these was written by `Dataset(Dict).save_to_disk`."""
_TEXT_UNITS = {"paragraph": "paragraph", "line": "line", "file": "document"}
_TEXT_BUILDERS = ("text", "json", "csv")
SNIFF_BYTES = 2**20
"""The head of a text file read before it is parsed: NUL bytes or bytes that are no UTF-8 there mean
the file is binary or in another encoding, refused at once rather than after the parser read it all."""
SPARSE_MIN_BYTES = 64 * 2**20
"""Files this large whose disk blocks hold under half their size are sparse (holes of zeros): refused."""
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
"""A Hub dataset id: a name, or an owner and a name (huggingface_hub's `validate_repo_id` rule, roughly)."""


def _has_hole(path: Path) -> bool:
    """Whether the file has a hole: few blocks on a compressing file system (ZFS, btrfs) are no hole."""
    with open(path, "rb") as f:
        try:
            return os.lseek(f.fileno(), 0, os.SEEK_HOLE) < os.fstat(f.fileno()).st_size
        except (AttributeError, OSError):  # no SEEK_HOLE here: the block count alone
            return True


def sniff(path: Path, builder: str) -> str | None:
    """What makes the file unfit to be parsed as `builder` (None: nothing found): not a regular file,
    sparse, or (text, JSON, CSV) binary or not UTF-8 in its first SNIFF_BYTES."""
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file (a pipe, socket or device)"
    blocks = getattr(st, "st_blocks", None)
    if blocks is not None and st.st_size >= SPARSE_MIN_BYTES and blocks * 512 < st.st_size // 2 and _has_hole(path):
        return f"{path} is a sparse file: {st.st_size:,} bytes of which {blocks * 512:,} are on disk (mostly holes)"
    if builder not in _TEXT_BUILDERS or any(s.lower() in _COMPRESSION for s in path.suffixes):
        return None
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    nul = head.find(b"\0")
    if nul >= 0:
        return f"{path} is binary: byte {nul} is NUL, which no {builder} text holds"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3 or len(head) < SNIFF_BYTES:  # not a character cut by the head's end
            return f"{path} is not UTF-8: byte {exc.start} ({head[exc.start]:#04x}) is no UTF-8 character"
    return None


@dataclass(frozen=True)
class Source:
    """One load call: local files of one builder, a `save_to_disk` directory, or a dataset name."""

    kind: str
    """"files", "disk" or "dataset"."""
    where: str
    """The config key it comes from, for error messages."""
    builder: str | None = None
    """The `datasets` builder for kind "files" (text, json, csv, parquet, arrow)."""
    files: tuple[Path, ...] = ()
    """The files (kind "files") or the one directory (kind "disk")."""
    options: tuple[tuple[str, str], ...] = ()
    """Extra builder arguments, e.g. (("sample_by", "paragraph"),) or (("sep", "\\t"),)."""
    name: str | None = None
    """Dataset name or path for kind "dataset"; also the split (`split`) of a DatasetDict directory."""
    config_name: str | None = None
    split: str | None = None
    listed: int | None = None
    """The entry of `data.datasets` it belongs to (None: train_files, dataset or the demo corpus)."""

    def describe(self) -> str:
        if self.kind == "dataset":
            return f"{self.name}" + (f" ({self.config_name})" if self.config_name else "") + f" split {self.split}"
        names = ", ".join(str(f) for f in self.files[:3]) + (f" and {len(self.files) - 3} more" if len(self.files) > 3 else "")
        return names + (f" split {self.split}" if self.kind == "disk" and self.split else "")


@dataclass
class DataSources:
    train: list[Source]
    validation: list[Source] = field(default_factory=list)
    """Empty: hold out `validation_ratio` of the training data."""


def _builder_of(path: Path, fmt: str) -> str | None:
    if fmt != "auto":
        return fmt
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in _COMPRESSION:
        suffixes.pop()
    return _BUILDERS.get(suffixes[-1]) if suffixes else None


def _is_disk_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in _DISK_MARKERS)


def _expand(config: RunConfig, entry: str, where: str, problems: list[Problem], split: str,
            listed: int | None) -> list[Path | Source]:
    """Files (or a ready `disk` Source) named by one train/validation entry."""
    path = config.resolve_path(entry)
    if _GLOB_CHARS & set(entry):
        # Every match but directories: a pipe or device it matches is refused by `sniff`, not passed over.
        found = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if not Path(p).is_dir())
        if not found:
            problems.append(Problem(where, f"the pattern {path} matches no file", "check the pattern"))
        return list(found)
    if _is_disk_dataset(path):
        return [Source("disk", where, files=(path,), split=split, listed=listed)]
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in
                                                                               p.relative_to(path).parts)
                       and _builder_of(p, config.data.format))
        if not found:
            problems.append(Problem(where, f"the directory {path} holds no data file",
                                    "use .txt, .json(l), .csv, .parquet or .arrow files, or a save_to_disk directory"))
        return list(found)
    if not path.exists():
        problems.append(Problem(where, f"{path} does not exist",
                                "check the path (relative paths are resolved against the YAML file's directory)"))
        return []
    return [path]


def _group(config: RunConfig, entries: list[tuple[str, str]], problems: list[Problem], split: str | None = None,
           listed: int | None = None) -> list[Source]:
    """Consecutive files of the same builder become one Source (one load_dataset call). `entries`:
    (path, its YAML key); `split` of a save_to_disk directory; `listed`: the data.datasets entry."""
    sources: list[Source] = []
    pending: list[tuple[Path, str, str, tuple]] = []

    def flush() -> None:
        if pending:
            _, where, builder, options = pending[0]
            sources.append(Source("files", where, builder, tuple(p for p, *_ in pending), options, listed=listed))
            pending.clear()

    for entry, where in entries:
        for item in _expand(config, entry, where, problems, split or config.data.split, listed):
            if isinstance(item, Source):
                flush()
                sources.append(item)
                continue
            builder = _builder_of(item, config.data.format)
            if builder is None:
                problems.append(Problem(where, f"unsupported file type of {item}",
                                        "use .txt, .json, .jsonl, .csv, .tsv, .parquet or .arrow (optionally "
                                        "compressed), or set data.format"))
                continue
            unfit = sniff(item, builder)
            if unfit is not None:
                problems.append(Problem(where, unfit, f"give a {builder} file in UTF-8 (convert it with iconv), "
                                        "or set data.format to what the file holds"))
                continue
            if item.stat().st_size == 0:
                problems.append(Problem(where, f"{item} is empty", "remove it from the list or fill it"))
                continue
            options: tuple = ()
            if builder == "text":
                options = (("sample_by", _TEXT_UNITS[config.data.text_unit]),)
            elif builder == "csv" and ".tsv" in [s.lower() for s in item.suffixes]:
                options = (("sep", "\t"),)
            if pending and (pending[0][2], pending[0][3]) != (builder, options):
                flush()
            pending.append((item, where, builder, options))
    flush()
    return sources


def _keyed(entries: list[str], key: str) -> list[tuple[str, str]]:
    return [(entry, f"{key}[{i}]") for i, entry in enumerate(entries)]


def is_hub_name(path: str) -> bool:
    """Whether a `data.datasets` path that names nothing on disk is a dataset name for `load_dataset`
    rather than a missing file: an id of the Hub's shape without a data file's extension."""
    return _HUB_NAME.fullmatch(path) is not None and _builder_of(Path(path), "auto") is None


def _listed(config: RunConfig, problems: list[Problem]) -> list[Source]:
    """The sources of each `data.datasets` entry, in order (an entry's files may need several loads)."""
    sources: list[Source] = []
    for i, entry in enumerate(config.data.datasets):
        where, local = f"data.datasets[{i}]", config.resolve_path(entry.path)
        if local.exists() or _GLOB_CHARS & set(entry.path) or not is_hub_name(entry.path):
            sources += _group(config, [(entry.path, where)], problems, entry.split, i)
        else:
            sources.append(Source("dataset", where, name=entry.path, config_name=entry.name, split=entry.split, listed=i))
    return sources


def check_entries(config: RunConfig) -> list[Problem]:
    """Every missing, empty or unsupported train/validation file, without reading any data."""
    problems: list[Problem] = []
    _group(config, _keyed(config.data.train_files, "data.train_files"), problems)
    _listed(config, problems)
    _group(config, _keyed(config.data.validation_files, "data.validation_files"), problems)
    return problems


def resolve_sources(config: RunConfig, plan_files: RunFiles | None = None,
                    plan_dir: Path | None = None, demo_path: Path | None = None) -> DataSources:
    """The training and validation sources of `config.data`; raises one UserError listing every
    missing or unreadable entry. The demo corpus comes from the run directory (`plan_files`) or,
    outside a run (`orchestrate prepare`), from `demo_path`."""
    data = config.data
    problems: list[Problem] = []
    if data.dataset is not None:
        local = config.resolve_path(data.dataset)
        if _is_disk_dataset(local):
            train = [Source("disk", "data.dataset", files=(local,), split=data.split)]
        else:  # a Hub name or a local dataset directory / script: load_dataset decides
            name = str(local) if local.exists() else data.dataset
            train = [Source("dataset", "data.dataset", name=name, config_name=data.dataset_config, split=data.split)]
    elif data.train_files:
        train = _group(config, _keyed(data.train_files, "data.train_files"), problems)
    elif data.datasets:
        train = _listed(config, problems)
    elif data.generate_demo_corpus:
        if plan_files and plan_files.demo_corpus and plan_dir is not None:
            path = plan_dir / plan_files.demo_corpus
        elif demo_path is not None:
            path = demo_path
        else:
            raise ValueError("resolve_sources needs the run's demo corpus (plan_files) or a demo_path")
        options = (("sample_by", "paragraph"),)
        train = [Source("files", "data.generate_demo_corpus", "text", (path,), options)]
    else:
        raise UserError("no training data", [Problem(
            "data.train_files", "no training files given",
            "list files under data.train_files (or sources under data.datasets), name a dataset in data.dataset, "
            "or set data.generate_demo_corpus: true")])

    validation: list[Source] = []
    if data.validation_files:
        validation = _group(config, _keyed(data.validation_files, "data.validation_files"), problems)
    elif data.validation_split is not None:
        if len(train) != 1 or train[0].kind not in ("dataset", "disk"):
            problems.append(Problem("data.validation_split", "a split can only be taken from data.dataset or "
                                    "a save_to_disk directory", "use data.validation_files for plain files"))
        else:
            t = train[0]
            validation = [Source(t.kind, "data.validation_split", files=t.files, name=t.name,
                                 config_name=t.config_name, split=data.validation_split)]
    if problems:
        raise UserError("the data section names data that cannot be read", problems)
    return DataSources(train, validation)


def _file_identity(path: Path) -> list:
    st = path.stat()
    if st.st_size <= HASH_CONTENT_BYTES:
        return ["blake2b", hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()]
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def source_identity(source: Source) -> dict:
    """What the cache key records about one source (see the module docstring)."""
    ident: dict = {"kind": source.kind, "builder": source.builder, "options": [list(o) for o in source.options],
                   "split": source.split, "config": source.config_name}
    if source.listed is not None:  # absent otherwise: the keys of train_files and dataset stay what they were
        ident["listed"] = source.listed
    if source.kind == "files":
        ident["files"] = [_file_identity(p) for p in source.files]
    elif source.kind == "disk":
        root = source.files[0]
        ident["files"] = [[str(p.relative_to(root)), *_file_identity(p)] for p in sorted(root.rglob("*")) if p.is_file()]
    else:
        local = Path(source.name)
        if local.exists():  # a local dataset directory or script: its files are the content
            files = sorted(local.rglob("*")) if local.is_dir() else [local]
            ident["files"] = [_file_identity(p) for p in files if p.is_file()]
        else:
            ident["name"] = source.name
    return ident


def total_bytes(sources: list[Source]) -> int | None:
    """Bytes of local input (None for a Hub dataset, whose size is unknown before downloading)."""
    total = 0
    for s in sources:
        if s.kind == "dataset" and not Path(s.name).exists():
            return None
        paths = s.files if s.kind == "files" else [p for p in Path(s.files[0] if s.files else s.name).rglob("*")]
        total += sum(os.path.getsize(p) for p in paths if os.path.isfile(p))
    return total
