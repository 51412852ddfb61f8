"""Workers never outlive their launcher: a worker whose parent dies is killed.

The parent is torchrun's agent. Under `orchestrate launch` that is the agent process the launcher
starts (orchestrate/agent), which guards its own parent the same way: a SIGKILLed launcher (which
cannot forward any signal) takes the agent with it, and the agent its ranks; before these guards a
killed launcher left the workers running under init, still checkpointing. Under launch.sh, srun or
SSH the parent is the torchrun process, which the same rule ties them to.

Two mechanisms, because each has a gap:
- PR_SET_PDEATHSIG (Linux prctl(2)): the kernel sends SIGKILL when the parent *thread* that
  forked us exits; immediate, but fires early if torchrun ever spawned from a short-lived thread
  and not at all on other systems.
- a watchdog thread that polls getppid() once a second: re-parenting to init (or a subreaper)
  means the parent died, whatever thread forked us.
SIGKILL, not SIGTERM: with the launcher gone nobody would enforce the grace period, and a rank
stuck in a collective with a dead peer would never get to its checkpoint. The last complete
checkpoint stays (the write protocol renames into place); `--resume` continues from it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_NAME = 15
POLL_S = 1.0


def prctl(option: int, arg: int | bytes) -> None:
    """Linux prctl(2); a no-op on other systems (callers have a fallback or can do without)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _set_pdeathsig() -> None:
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))  # elsewhere the watchdog below still applies


def _watch(parent: int) -> None:
    while True:
        time.sleep(POLL_S)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)


_guarded_in: int | None = None
"""The process whose guard runs (a forked child inherits this value but not the watchdog thread)."""


def guard_parent(parent: int | None = None) -> None:
    """Die with the parent process, from now on; exits at once when it died already. `parent`: the pid
    the parent must have, where the caller knows it (a rank forked by torchrun's agent): without it a
    rank whose parent died before this call would take init for its parent and guard that."""
    global _guarded_in
    if _guarded_in == os.getpid():
        return
    parent = parent or os.getppid()
    _set_pdeathsig()
    if os.getppid() != parent:  # died before the prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_watch, args=(parent,), name="orchestrate-parent-watchdog", daemon=True).start()
    _guarded_in = os.getpid()
