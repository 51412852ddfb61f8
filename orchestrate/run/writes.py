"""Every write into a run directory after the launcher's checks, through one rule: never through a
symbolic link. The launcher and each worker refuse a run directory holding links at their start
(`layout.check_no_links`); these helpers refuse one at the moment of the write, so a link placed while
the run trains (RUN_DIR/model replaced by a link to another disk) is refused, not written through.

- `refuse_links_on(run_dir, path)`: no component of `path` below `run_dir` is a link, and `path`
  resolves inside `run_dir`. Looked at (lstat), never followed.
- `write_file(run_dir, path, text)`: a small file orchestrate writes itself (meta.json, manifest.json,
  `latest`), written whole into a temporary opened with O_NOFOLLOW | O_EXCL relative to its
  directory's descriptor (itself opened with O_NOFOLLOW) and renamed over the name: a link at the
  name is replaced, never followed.
- `staged_dir(run_dir, names)`: libraries write by path (safetensors, `save_pretrained`, a
  tokenizer's save), so the final model is written into a fresh directory inside the run directory,
  checked for links once written, and moved into place (`RUN_DIR/model`, `RUN_DIR/adapter`) with a
  rename. A link at the destination is refused; an earlier model there is replaced.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from orchestrate.errors import Problem, UserError

STAGING_DIR = ".tmp-save"
"""RUN_DIR/.tmp-save/: the final model (and adapter) while it is written, before it is moved into place."""


def link_error(link: Path, run_dir: Path) -> UserError:
    """The one message for a write refused because of a link: which link, where it points, what to do."""
    try:
        target = os.readlink(link)
    except OSError:
        target = "somewhere else"
    return UserError("refused to write through a symbolic link in the run directory", [Problem(
        str(link), f"a symbolic link to {target}, placed while the run was going: orchestrate writes only "
        f"inside {run_dir} and never through a link (nothing was written there)",
        f"remove the link (rm {link}) and `orchestrate launch CONFIG --resume --run-dir {run_dir}`")])


def refuse_links_on(run_dir: Path, path: Path) -> None:
    """UserError when a component of `path` (at or below `run_dir`) is a symbolic link, or when
    `path` does not resolve inside `run_dir`. Components that do not exist yet are fine."""
    run_dir, path = Path(run_dir), Path(path)
    current = run_dir
    for part in path.relative_to(run_dir).parts:
        current = current / part
        if current.is_symlink():
            raise link_error(current, run_dir)
    real, root = os.path.realpath(path), os.path.realpath(run_dir)
    if os.path.commonpath([real, root]) != root:
        raise link_error(path, run_dir)


def refuse_links_in(run_dir: Path, tree: Path) -> None:
    """`refuse_links_on` for `tree` and for everything below it (a link inside a written directory)."""
    refuse_links_on(run_dir, tree)
    for parent, dirs, files in os.walk(tree):  # followlinks=False: a linked directory is listed, not entered
        for name in (*dirs, *files):
            if (Path(parent) / name).is_symlink():
                raise link_error(Path(parent) / name, Path(run_dir))


def write_file(run_dir: Path, path: Path, text: str) -> None:
    """Write `text` to `path` inside `run_dir`, whole (temporary + rename), never through a link."""
    path = Path(path)
    refuse_links_on(run_dir, path.parent)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    tmp = f"{path.name}.tmp-{os.getpid()}"
    try:
        try:
            os.unlink(tmp, dir_fd=directory)  # what a crash left (a link there is removed, not followed)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path.name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            os.unlink(tmp, dir_fd=directory)
            raise
    finally:
        os.close(directory)


def _remove_staging(staging: Path) -> None:
    if staging.is_symlink():
        staging.unlink()
    else:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def staged_dir(run_dir: Path, names: Iterable[str], writer: bool = True) -> Iterator[Path]:
    """A fresh RUN_DIR/.tmp-save to write `names` (folders of the run directory) into by path: when the
    block ends, each one written there is checked for links and renamed into RUN_DIR/<name>. A link at
    RUN_DIR/<name> (or in what was written) is a UserError naming it, and nothing is moved. `writer`:
    this process writes (rank 0); other ranks get the same path and write nothing."""
    run_dir = Path(run_dir)
    staging = run_dir / STAGING_DIR
    if not writer:
        yield staging
        return
    names = list(names)
    for name in names:  # refused before the save, not after minutes of gathering weights
        refuse_links_on(run_dir, run_dir / name)
    _remove_staging(staging)  # what a crash during an earlier save left
    staging.mkdir(mode=0o700)
    try:
        yield staging
        refuse_links_in(run_dir, staging)
        for name in names:
            written = staging / name
            if written.is_dir():
                _place(run_dir, written, run_dir / name)
    finally:
        _remove_staging(staging)


def _place(run_dir: Path, written: Path, final: Path) -> None:
    """Rename `written` to `final` (an earlier directory there is replaced), never onto a link."""
    refuse_links_on(run_dir, final)  # a link placed since: renaming a directory onto it fails anyway
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, old)
        os.rename(written, final)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.rename(written, final)
