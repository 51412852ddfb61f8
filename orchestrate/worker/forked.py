"""One rank forked by torchrun's agent (orchestrate.agent.process): what `python -m orchestrate.worker
PLAN` does, as a function torchrun's `start_method="fork"` can run; and the worker's own modules,
which the agent imports before it forks."""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import signal
import sys

from orchestrate.run.exits import EX_PEER_LOST, EX_TEMPFAIL, STOP_SIGNALS
from orchestrate.worker.main import main
from orchestrate.worker.orphans import guard_parent

# What a worker imports on its way to step 1 beyond torch and transformers (each brings its own
# dependencies; the list came from comparing sys.modules in the agent and in a rank at step 1).
# All three backends: their modules are light (the engines import lazily).
WORKER_MODULES = (
    "orchestrate.worker.stages", "orchestrate.worker.loop", "orchestrate.worker.callbacks.standard",
    "orchestrate.worker.checkpointing", "orchestrate.worker.rank_start", "orchestrate.worker.objective",
    "orchestrate.worker.preload", "orchestrate.data.pipeline", "orchestrate.backends.ddp",
    "orchestrate.backends.fsdp", "orchestrate.backends.deepspeed_backend", "orchestrate.backends.hf_io",
    "orchestrate.loading.init_weights", "orchestrate.loading.weights", "orchestrate.methods.registry",
    "orchestrate.methods.lora.quantized_loading", "orchestrate.loading.host_embedding",
)


def import_worker_modules() -> None:
    for name in WORKER_MODULES:
        importlib.import_module(name)


class RankBoard:
    """What the agent and the ranks it forked tell each other, in memory they share (made by the
    agent before torchrun forks, so every rank inherits it): each rank's outcome, and whether the
    agent is stopping the group on a signal. torchrun reports one failure of forked ranks and reads
    no exit status of a rank that finished; the board says which rank failed on its own, which died
    without a word (kill -9, the out-of-memory killer), and when every rank had finished before a
    stop signal came."""

    RUNNING, DONE, FAILED, PEER_LOST, STOPPED = 1, 2, 3, 4, 5

    def __init__(self, nprocs: int) -> None:
        self.nprocs = nprocs
        self.agent_pid = os.getpid()  # every rank's parent
        self._stopping = multiprocessing.Value("b", 0, lock=False)
        self._states = multiprocessing.Array("i", 2 * nprocs, lock=False)  # (state, global rank) per local rank

    def set(self, local_rank: int, state: int, rank: int) -> None:
        self._states[2 * local_rank], self._states[2 * local_rank + 1] = state, rank

    def ranks_in(self, state: int) -> list[int]:
        return [self._states[2 * i + 1] for i in range(self.nprocs) if self._states[2 * i] == state]

    @property
    def all_done(self) -> bool:
        return len(self.ranks_in(self.DONE)) == self.nprocs

    def stopping(self) -> None:
        self._stopping.value = 1

    @property
    def is_stopping(self) -> bool:
        return bool(self._stopping.value)


BOARD: RankBoard | None = None
"""Set in torchrun's agent process (share_board) before it forks the ranks."""


def share_board(nprocs: int) -> RankBoard:
    global BOARD
    BOARD = RankBoard(nprocs)
    return BOARD


def outcome(code: int) -> int:
    return {0: RankBoard.DONE, EX_TEMPFAIL: RankBoard.STOPPED, EX_PEER_LOST: RankBoard.PEER_LOST}.get(
        code, RankBoard.FAILED)


def _exit_now(signum: int, frame: object) -> None:
    """A stop signal after this rank finished: the agent is stopping the group and will not collect
    the return value torchrun's wrapper waits to hand over (it would wait out the grace period)."""
    if BOARD is not None and BOARD.is_stopping:
        _flush()
        os._exit(0)


def _flush() -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()


def run(plan_path: str) -> None:
    """Train one rank of `plan_path`; a non-zero exit status leaves as SystemExit (torchrun then
    reports that rank as failed with it, as for a spawned worker). The rank's outcome goes on the
    agent's board."""
    import torch

    if BOARD is not None:
        guard_parent(BOARD.agent_pid)  # before anything else: the agent may have died since the fork
    # The agent's handler for these (torchrun's: it raises in the agent's main thread) came along with
    # the fork; a spawned rank starts with the defaults, and so does this one. The worker then installs
    # its own for SIGTERM/SIGHUP/SIGQUIT/SIGUSR1 (orchestrate.worker.signals).
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    # OpenMP read OMP_NUM_THREADS when the agent imported torch, before torchrun set this rank's value.
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    local, rank = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("RANK", 0))
    if BOARD is not None:
        BOARD.set(local, RankBoard.RUNNING, rank)
    try:
        code = main([plan_path])
    except BaseException:
        if BOARD is not None:
            BOARD.set(local, RankBoard.FAILED, rank)
        raise
    if BOARD is not None:
        BOARD.set(local, outcome(code), rank)
    _flush()
    if code:
        raise SystemExit(code)
    for sig in STOP_SIGNALS:
        if sig != signal.SIGINT:
            signal.signal(sig, _exit_now)
    _exit_now(0, None)  # the agent began stopping while this rank finished
