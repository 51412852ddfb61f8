"""The run directory's lock: RUN_DIR/.lock, `fcntl.flock`ed exclusively by the launcher for the
whole launch (every transport, dry runs included: they write the directory too), so a second
launch or resume of the same directory is refused while the first still writes. The file names
its holder (host, pid, since); the kernel drops the flock when the holder dies, so a lock left by
a killed launcher is free again. Where the filesystem has no flock (some network filesystems:
ENOLCK, EOPNOTSUPP) the holder record decides: a record naming a dead pid on this host is stale
and taken over, any other is honoured.

Workers check it at start (`foreign_holder`): a lock held on this host by a live process that is
not one of their ancestors (their launcher, through torchrun or its agent process) means another launch owns
the run. A launcher whose workers are not its descendants (srun, SSH) says so in the record
(`remote_workers`), and its workers then accept it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.errors import Problem, UserError
from orchestrate.run.layout import LOCK_FILE

_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def read_holder(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((Path(run_dir) / LOCK_FILE).read_text() or "null")
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another process (it left no record)"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')} ({holder.get('what')})"


def _locked_error(run_dir: Path, holder: dict[str, Any] | None) -> UserError:
    return UserError("the run directory is in use by another launch", [Problem(
        str(Path(run_dir) / LOCK_FILE), f"locked by {_describe(holder)}",
        "wait for that launch to end (or stop it), or give another --run-dir")])


@dataclass
class RunLock:
    """The held lock; `release()` (or the end of the process) frees it."""

    path: Path
    fd: int | None

    @classmethod
    def acquire(cls, run_dir: Path, what: str, remote_workers: bool = False) -> RunLock:
        """Lock `run_dir` (created if missing) or raise UserError naming the holder."""
        path = Path(run_dir) / LOCK_FILE
        try:  # O_NOFOLLOW: a .lock linked to another file must not be truncated below (ELOOP instead)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UserError("the run directory's lock file is a symbolic link", [Problem(
                    str(path), f"a link to {os.readlink(path)}, which locking would overwrite",
                    f"remove the link (rm {path}), or give another directory")]) from None
            raise UserError("cannot lock the run directory", [Problem(
                str(path), exc.strerror or str(exc), "give a run directory you can write to (--run-dir)")]) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _locked_error(run_dir, read_holder(run_dir)) from None
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise
            holder = read_holder(run_dir)
            if holder and (holder.get("host") != socket.gethostname() or _pid_alive(int(holder.get("pid", 0)))):
                os.close(fd)
                raise _locked_error(run_dir, holder) from None
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "what": what, "remote_workers": remote_workers}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)  # no holder record: nobody holds it (the file stays, see flock(2) races)
        os.close(self.fd)  # closing drops the flock
        self.fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _ancestors() -> set[int]:
    """This process and its ancestors, from /proc (Linux)."""
    pids, pid = {os.getpid()}, os.getpid()
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4, after the parenthesised name
        pids.add(pid)
    return pids


def foreign_holder(run_dir: Path) -> dict[str, Any] | None:
    """The holder record when the run directory is locked by a live launch that is not this
    worker's own (see the module docstring); None when the worker may run."""
    holder = read_holder(run_dir)
    if not holder or holder.get("host") != socket.gethostname():
        return None  # free, or held on another host (srun / SSH workers run away from their launcher)
    pid = int(holder.get("pid", 0))
    if holder.get("remote_workers") or pid in _ancestors() or not _pid_alive(pid):
        return None
    return holder


def check_worker_may_run(run_dir: Path) -> None:
    holder = foreign_holder(run_dir)
    if holder is not None:
        raise _locked_error(run_dir, holder)
