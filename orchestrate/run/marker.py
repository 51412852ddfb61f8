"""The marker that makes a directory an orchestrate run: RUN_DIR/.orchestrate-run, written first
by `prepare_run`. Only a marked directory (or an empty or new one) is written into as a run
directory, so a user's own files are never replaced by config.yaml, plan.json, launch.sh, ...
(issue 10: `--run-dir .` used to overwrite the input YAML itself).

    new or empty directory                -> written, marker first
    marked run directory                  -> written (only orchestrate's own files are replaced)
    non-empty, unmarked, none of the
      names orchestrate writes there      -> refused; --force adds the run (nothing is replaced)
    non-empty, unmarked, with such names  -> refused, --force or not: those files are the user's
    the config file's own directory       -> refused: the run's files would sit among the inputs
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

from orchestrate.errors import Problem, UserError
from orchestrate.run.layout import MARKER_FILE


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
