"""The launcher's side of torchrun's agent process (orchestrate.agent): start it before planning,
hand it the torchrun arguments once the run directory is written, relay its output and the stop
signals the launcher gets, and read its exit code and messages.

Signals: the agent sits in a session of its own (with the workers it forks; `start_new_session`,
which Python 3.10 has), so a Ctrl-C at the terminal reaches the launcher only, and the launcher
forwards every stop signal once; torchrun in the agent then stops the workers as it always does
(forwards the signal, waits the grace period)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from orchestrate.launch.output_relay import relay_output
from orchestrate.launch.torchrun_args import without_teed_prefix
from orchestrate.run.exits import STOP_SIGNALS

if TYPE_CHECKING:
    from collections.abc import Callable

    from orchestrate.config.schema import RunConfig

AGENT_PROGRAM = ("-m", "orchestrate.agent")
"""What the agent runs as, after the interpreter (a constant, so that a benchmark can put a timed
wrapper here)."""


@dataclass
class WarmAgent:
    process: subprocess.Popen
    reply: IO[str]
    pumps: list[threading.Thread] = field(default_factory=list)

    @classmethod
    def start(cls, config: RunConfig) -> WarmAgent:
        """The agent, importing the workers' code for `config` from now on."""
        read_fd, write_fd = os.pipe()
        process = subprocess.Popen([sys.executable, *AGENT_PROGRAM, str(write_fd)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        agent = cls(process, os.fdopen(read_fd))
        agent.pumps = relay_output(process, without_teed_prefix)  # rank 0's lines without torchrun's prefix
        # As plan.json carries it (Plan.to_dict): the agent rebuilds it with config.load.config_from_dict.
        agent._send({"config": config.model_dump(mode="json"),
                     "source_dir": str(config.source_dir) if config.source_dir else None})
        return agent

    def _send(self, message: dict) -> None:
        self.process.stdin.write((json.dumps(message) + "\n").encode())
        self.process.stdin.flush()

    def run(self, argv: list[str], env: dict[str, str], run_dir: Path, say: Callable[[str], None]) -> int:
        """torchrun with `argv` in the agent, until the workers end; its exit code."""
        with _Forwarder(self.process.pid):
            try:
                self._send({"argv": argv, "env": env, "run_dir": str(run_dir)})
                self.process.stdin.close()
            except BrokenPipeError:
                pass  # it died already: told below, with its exit code
            line = self.reply.readline()
            code = self.process.wait()
        for pump in self.pumps:
            pump.join()
        if not line:  # the agent died before it could reply (killed, or a crash it could not report)
            say(f"torchrun's agent process ended with exit code {code} before the workers finished")
            return code if code > 0 else 1
        reply = json.loads(line)
        for message in reply["messages"]:
            say(message)
        return reply["code"]

    def close(self) -> None:
        """After `run`, or instead of it (a refused launch, a stop before the workers): an agent still
        running has started nothing and holds nothing, so it is killed rather than left to finish
        its imports."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pump in self.pumps:
            pump.join()
        self.reply.close()


def _detach_from_terminal() -> None:
    """After SIGHUP (the terminal or SSH session went away) this process's output goes to /dev/null
    where it went to a terminal: writing there now fails (EIO), and a failed print would end the
    launcher, and with it (its children die with it) the checkpoint the workers are writing. The
    run's own output stays in RUN_DIR/logs."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if stat.S_ISCHR(os.fstat(fd).st_mode):  # a terminal (isatty may fail once it hung up)
                os.dup2(devnull, fd)
    os.close(devnull)


class _Forwarder:
    """While inside: the first of each stop signal this launcher gets goes to the agent (main thread
    only: signal.signal's rule; elsewhere nothing is installed and the default applies)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sent: set[int] = set()
        self.previous: dict[int, object] = {}

    def _forward(self, signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            _detach_from_terminal()
        if signum not in self.sent:
            self.sent.add(signum)
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def __enter__(self) -> _Forwarder:
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._forward) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
