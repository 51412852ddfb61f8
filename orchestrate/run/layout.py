"""The run directory on disk: every file and folder name, defined once (see the package docstring),
its paths (`RunDir`), and the small files that mark it.

The marker, RUN_DIR/.orchestrate-run, makes a directory an orchestrate run: written first by
`prepare_run`. Only a marked directory (or an empty or new one) is written into as a run
directory, so a user's own files are never replaced by config.yaml, plan.json, launch.sh, ...
(`--run-dir .` used to overwrite the input YAML itself):

    new or empty directory                -> written, marker first
    marked run directory                  -> written (only orchestrate's own files are replaced)
    non-empty, unmarked, none of the
      names orchestrate writes there      -> refused; --force adds the run (nothing is replaced)
    non-empty, unmarked, with such names  -> refused, --force or not: those files are the user's
    the config file's own directory       -> refused: the run's files would sit among the inputs

The REQUEUE marker: workers that checkpointed on a stop signal leave RUN_DIR/REQUEUE. torchrun
reports any failed worker as exit 1, so the marker file is what callers read: `orchestrate launch`
exits EX_TEMPFAIL (75) when it is there, and a batch script can test `[ -f RUN_DIR/REQUEUE ]`. A
worker that starts removes it. Likewise RUN_DIR/oom/rank-<N>.json: a rank that ran out of device
memory says where and how much (exit EX_OUT_OF_MEMORY, 71); the launcher reads and clears them.

RUN_DIR/metrics.jsonl holds one JSON object per optimizer step, written by rank 0 (`read_records`).
OS errors while writing a run directory or an output directory (read-only, no space, not a
directory) become one UserError naming the path and the fix (`os_errors_as_user_errors`)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.errors import Problem, UserError
from orchestrate.run.writes import write_file

PLAN_FILE = "plan.json"
CONFIG_FILE = "config.yaml"
ACCELERATE_FILE = "accelerate.yaml"
LOG_DIR = "logs"
LAUNCH_SCRIPT = "launch.sh"
SBATCH_SCRIPT = "job.sbatch"
METRICS_FILE = "metrics.jsonl"
INIT_MODEL_DIR = "init_model"
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
"""A LoRA / QLoRA run's adapter in PEFT format (MODEL_DIR holds the merged model)."""
DEMO_CORPUS_FILE = "data/demo_corpus.txt"
TEACHER_CACHE_DIR = "teacher_cache"
"""distill.placement precomputed: the teacher's top-k logits per training token (numpy memmaps)."""
REFERENCE_LOGPS_DIR = "reference_logps"
"""preference.placement precomputed: the reference's answer log-probabilities per record (numpy memmaps)."""
REQUEUE_FILE = "REQUEUE"
OOM_DIR = "oom"
"""A worker that ran out of device or host memory writes oom/rank-<N>.json (`write_oom_record`); the
launcher reads them (`read_oom_records`) and clears them before the next start."""
MARKER_FILE = ".orchestrate-run"
"""Written first into every run directory: what makes a directory orchestrate's (`write_marker`)."""
LOCK_FILE = ".lock"
"""flock'ed by the launcher for the whole launch; names its holder (`orchestrate.run.lock`)."""
EXPORT_MARKER_FILE = ".orchestrate-export"
"""Written by `orchestrate export` into its output directory, so that it may replace its own files."""
REPORT_DIR = "report"
"""`orchestrate report RUN_DIR` writes its PNGs and summary.md here unless --out says otherwise."""
REPORT_MARKER_FILE = ".orchestrate-report"
"""Written first by `orchestrate report` into its output directory, as EXPORT_MARKER_FILE."""

WORKER_MODULE = "orchestrate.worker"
"""What torchrun runs on every rank: `python -m orchestrate.worker RUN_DIR/plan.json`."""


USER_PROGRAM_MODULE = "orchestrate.loop_api.run"
"""What torchrun runs for `launch -- python train.py ARGS`: `python -m orchestrate.loop_api.run
RUN_DIR/plan.json -- train.py ARGS` (the plan path is its argument; the script gets its own argv)."""


def worker_program(plan_path: Path, module: str = WORKER_MODULE, program: tuple[str, ...] = ()) -> tuple[str, ...]:
    """torchrun's program arguments for the workers of `plan_path` (`module`: a wrapper that ends in
    `orchestrate.worker.main.main`, e.g. a benchmark's). With the user's own `program`
    (`SCRIPT ARGS` or `-m MODULE ARGS`), that program under the plan instead (docs/own-loop.md)."""
    if program:
        return ("-m", USER_PROGRAM_MODULE, str(plan_path), "--", *program)
    return ("-m", module, str(plan_path))


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory."""

    path: Path

    @property
    def plan(self) -> Path:
        return self.path / PLAN_FILE

    @property
    def adapter(self) -> Path:
        return self.path / ADAPTER_DIR

    @property
    def config(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def logs(self) -> Path:
        return self.path / LOG_DIR

    @property
    def launch_script(self) -> Path:
        return self.path / LAUNCH_SCRIPT

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def init_model(self) -> Path:
        return self.path / INIT_MODEL_DIR

    @property
    def model(self) -> Path:
        return self.path / MODEL_DIR

    @property
    def requeue(self) -> Path:
        return self.path / REQUEUE_FILE

    @property
    def oom(self) -> Path:
        return self.path / OOM_DIR

    @property
    def marker(self) -> Path:
        return self.path / MARKER_FILE

    @property
    def lock(self) -> Path:
        return self.path / LOCK_FILE


def write_marker(run_dir: Path) -> Path:
    path = Path(run_dir) / MARKER_FILE
    if not path.exists():
        path.write_text(json.dumps({"orchestrate_run": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
    return path


def is_run_dir(path: Path) -> bool:
    return (Path(path) / MARKER_FILE).is_file()


def _entries(path: Path) -> list[str]:
    try:
        return sorted(p.name for p in path.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _short(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_run_dir_writable(run_dir: Path, writes: Iterable[str], config_dir: Path | None = None,
                           force: bool = False, where: str = "--run-dir") -> None:
    """UserError unless `run_dir` may be written as a run directory (the table of the module
    docstring). `writes`: the names (relative paths) the run directory is about to get."""
    run_dir = Path(run_dir).resolve()
    if config_dir is not None and Path(config_dir).resolve() == run_dir and not is_run_dir(run_dir):
        raise UserError("the run directory is the config file's own directory", [Problem(
            where, f"{run_dir} holds the config and its inputs; the run's config.yaml, plan.json, launch.sh, "
            "... would be written among (or over) them", f"give a new directory: {where} NEW")])
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError("the run directory is a file", [Problem(where, f"{run_dir} is not a directory",
                                                                f"give a new directory: {where} NEW")])
    entries = _entries(run_dir)
    if not entries or is_run_dir(run_dir):
        return
    taken = sorted({w for w in writes if (run_dir / w).exists()})
    if taken:
        raise UserError("the directory is not an orchestrate run directory", [Problem(
            where, f"{run_dir} already holds {_short(taken)}, which orchestrate did not write "
            f"(no {MARKER_FILE}) and would replace", f"give a new directory: {where} NEW")])
    if not force:
        raise UserError("the directory is not empty and not an orchestrate run directory", [Problem(
            where, f"{run_dir} holds {_short(entries)} (no {MARKER_FILE})",
            f"give a new directory: {where} NEW, or add --force to put the run there "
            "(none of those files would be replaced)")])


def check_output_dir(out_dir: Path, marker: str, writes: str, owned: bool = False) -> None:
    """UserError unless `out_dir` (an `--out DIR`) is new, empty, or was written by the same command
    before (it holds `marker`, which that command writes first) or `owned` (the caller knows it is
    its own): a command never replaces files it did not write. `writes`: what it would put there."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError("the output directory is a file", [Problem("--out", f"{out_dir} is not a directory",
                                                                   "give a new directory: --out NEW")])
    entries = _entries(out_dir)
    if entries and marker not in entries and not owned:
        raise UserError("the output directory holds files orchestrate did not write", [Problem(
            "--out", f"{out_dir} holds {_short(entries)}; {writes} would replace any of the same name",
            "give a new directory: --out NEW (or empty that one)")])


def check_no_links(run_dir: Path, writes: Iterable[str] = ()) -> None:
    """UserError naming every symbolic link where orchestrate writes in `run_dir`: anywhere in a
    marked run directory (all of it is orchestrate's), else at the names in `writes` and below. A
    write through such a link would land outside the run (RUN_DIR/.lock linked to a user's file
    was truncated by the lock). Links are looked at, never followed."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    names = _entries(run_dir) if is_run_dir(run_dir) else sorted({Path(w).parts[0] for w in writes})
    links = []
    for name in names:
        top = run_dir / name
        if top.is_symlink():
            links.append(top)
        elif top.is_dir():
            for parent, dirs, files in os.walk(top):  # followlinks=False: a linked directory is listed, not entered
                links += [Path(parent) / n for n in (*dirs, *files) if (Path(parent) / n).is_symlink()]
    if links:
        raise UserError("the run directory holds symbolic links", [Problem(
            str(link), f"a symbolic link to {os.readlink(link)}: orchestrate writes only inside its run directory "
            "and never through a link", f"remove the link (rm {link}), or give another directory") for link in links[:5]])


def write_requeue(run_dir: Path, record: dict[str, Any]) -> Path:
    path = Path(run_dir) / REQUEUE_FILE
    write_file(run_dir, path, json.dumps(record) + "\n")  # whole, never through a link
    return path


def read_requeue(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / REQUEUE_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return {}  # present but unreadable: still a request to requeue


def clear_requeue(run_dir: Path) -> None:
    (Path(run_dir) / REQUEUE_FILE).unlink(missing_ok=True)


def write_oom_record(run_dir: Path, rank: int, record: dict[str, Any]) -> Path:
    """RUN_DIR/oom/rank-<rank>.json, written whole (`write_file`: temporary + rename, never through a
    link): each rank its own file, since after an out-of-memory error no collective is safe."""
    folder = Path(run_dir) / OOM_DIR
    folder.mkdir(exist_ok=True)
    path = folder / f"rank-{rank}.json"
    write_file(run_dir, path, json.dumps(record) + "\n")
    return path


def read_oom_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's out-of-memory record, by rank; unreadable ones are skipped (a rank killed mid-write
    left only its .tmp, which is not read)."""
    records = []
    for path in sorted((Path(run_dir) / OOM_DIR).glob("rank-*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return sorted(records, key=lambda r: r.get("rank", 0))


def clear_oom_records(run_dir: Path) -> None:
    for path in (Path(run_dir) / OOM_DIR).glob("rank-*.json*"):
        path.unlink(missing_ok=True)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The metrics lines; a torn last line (a run still writing, or killed mid-write) is skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


@contextmanager
def os_errors_as_user_errors(flag: str) -> Iterator[None]:
    """Turn an OSError raised inside into a UserError; `flag` is the option that names the directory."""
    try:
        yield
    except OSError as exc:
        path = exc.filename or "the output directory"
        raise UserError("cannot write the output", [Problem(
            str(path), exc.strerror or str(exc),
            f"make it writable, or give a directory you can write to ({flag} NEW)")]) from None
