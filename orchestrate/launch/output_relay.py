"""Relaying a launched process's output (torchrun's agent, srun) to the launcher's own streams line
by line, each line as shown (torchrun's teed prefix dropped: launch/torchrun_args.py TEED_PREFIX)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO


def relay_lines(source: IO[bytes], target: Callable[[], IO[str]], shown: Callable[[str], str]) -> None:
    """Copy `source` line by line to the stream `target()` gives as it is now (a progress bar or
    click's test runner may have replaced sys.stdout), each as `shown(line)`. A stream that no longer
    takes writes (a terminal that hung up: EIO) is skipped, but the pipe is still read to its end: a
    full pipe would block the writer, and with it the workers' shutdown."""
    for line in iter(source.readline, b""):
        try:
            stream = target()
            stream.write(shown(line.decode(errors="replace")))
            stream.flush()
        except (OSError, ValueError):  # EIO, EPIPE; ValueError: a closed stream
            pass
    source.close()


def relay_output(process: subprocess.Popen, shown: Callable[[str], str]) -> list[threading.Thread]:
    """Started threads relaying `process`'s stdout and stderr (pipes) to sys.stdout and sys.stderr,
    each line as `shown(line)`; join them once the process has ended."""
    relays = [threading.Thread(target=relay_lines, args=(process.stdout, lambda: sys.stdout, shown), daemon=True),
              threading.Thread(target=relay_lines, args=(process.stderr, lambda: sys.stderr, shown), daemon=True)]
    for relay in relays:
        relay.start()
    return relays
