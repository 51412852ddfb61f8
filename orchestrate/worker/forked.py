"""One rank forked by torchrun's agent (orchestrate.agent.process): what `python -m orchestrate.worker
PLAN` does, as a function torchrun's `start_method="fork"` can run; and the worker's own modules,
which the agent imports before it forks."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys

from orchestrate.run.exits import STOP_SIGNALS
from orchestrate.worker.main import main

# What a worker imports on its way to step 1 beyond torch and transformers (each brings its own
# dependencies; the list came from comparing sys.modules in the agent and in a rank at step 1).
# All three backends: their modules are light (the engines import lazily).
WORKER_MODULES = (
    "orchestrate.worker.stages", "orchestrate.worker.loop", "orchestrate.worker.callbacks.standard",
    "orchestrate.worker.checkpointing", "orchestrate.worker.dist_env", "orchestrate.worker.objective",
    "orchestrate.worker.preload", "orchestrate.data.pipeline", "orchestrate.backends.ddp",
    "orchestrate.backends.fsdp", "orchestrate.backends.deepspeed_backend", "orchestrate.backends.hf_io",
    "orchestrate.loading.init_weights", "orchestrate.loading.weights", "orchestrate.loading.transforms",
    "orchestrate.methods.lora.quantized_loading", "orchestrate.loading.host_embedding",
)


def import_worker_modules() -> None:
    for name in WORKER_MODULES:
        importlib.import_module(name)


def run(plan_path: str) -> None:
    """Train one rank of `plan_path`; a non-zero exit status leaves as SystemExit (torchrun then
    reports that rank as failed with it, as for a spawned worker)."""
    import torch

    # The agent's handler for these (torchrun's: it raises in the agent's main thread) came along with
    # the fork; a spawned rank starts with the defaults, and so does this one. The worker then installs
    # its own for SIGTERM/SIGUSR1 (orchestrate.worker.signals).
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    # OpenMP read OMP_NUM_THREADS when the agent imported torch, before torchrun set this rank's value.
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    code = main([plan_path])
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        raise SystemExit(code)
