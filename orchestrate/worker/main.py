"""The worker's whole life, as a recipe in stages (in the manner of torchtitan's `Trainer`):

    plan -> process group -> data -> the methods' auxiliary models -> model (initial weights; built
    by the base method with the methods' transforms, inside the backend) -> wrap (backend engine,
    with the objective of the task and the methods) -> resume -> start-up cache released -> step
    loop with callbacks (the methods', evaluation, metrics, progress, checkpoints, stop signals) ->
    consolidated Hugging Face model and what the methods save.

Fault tolerance (docs/fault-tolerance.md): whenever RUN_DIR/checkpoints/latest names a complete
checkpoint the worker continues from it, so `orchestrate launch --resume`, a torchrun restart
(`--max-restarts`) and a SLURM requeue all resume the same way. SIGTERM/SIGUSR1 make every rank
finish the step, checkpoint at the same step and exit EX_TEMPFAIL (75) with RUN_DIR/REQUEUE; the
handler is installed first thing, so a signal during start-up stops at step 1 the same way.

A worker dies with its parent, torchrun's agent (orchestrate.worker.orphans), and refuses to start
in a run directory locked by another launch (orchestrate.run.lock).

Everything comes from plan.json (the launcher's only channel); the environment supplies only
torchrun's rank variables and the library settings recorded in the plan's run section (NCCL).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.errors import UserError
from orchestrate.run.exits import EX_OUT_OF_MEMORY, EX_PEER_LOST, EX_TEMPFAIL, EXIT_USER_ERROR
from orchestrate.worker.callbacks.base import Training
from orchestrate.worker.oom import StepOutOfMemory, host_out_of_memory, record_oom
from orchestrate.worker.orphans import PR_SET_NAME, guard_parent, prctl
from orchestrate.worker.preload import start_preload
from orchestrate.worker.signals import StopRequest

if TYPE_CHECKING:
    import threading

    from orchestrate.backends.rank import Rank
    from orchestrate.planner.plan import RunPlan
    from orchestrate.run.layout import RunDir


def train(plan_path: Path, stop: StopRequest) -> int:
    """Run the plan on this rank; returns the exit status: 0 when done, EX_TEMPFAIL when a signal
    stopped it early (RUN_DIR/REQUEUE says from which checkpoint to resume), EX_OUT_OF_MEMORY when
    the device or the host ran out of memory (RUN_DIR/oom/rank-<N>.json says where). Collective."""
    from orchestrate.worker import stages

    plan, run = stages.read_plan(plan_path)
    stages.check_run_dir(run)
    preload = start_preload(plan)  # the model's code imports while the ranks meet (worker/preload.py)
    rank = stages.start_process_group(plan)
    # Out of memory: no barrier, no destroy_process_group: a peer may be gone or stuck in a collective;
    # torchrun stops the others. The launcher reads the record: it re-plans a device shortfall
    # (launch/oom_replan.py) and words a host one.
    try:
        return _train(plan, run, rank, preload, stop)
    except StepOutOfMemory as oom:
        record_oom(plan, rank, run.path, oom.step, oom.phase, oom.__cause__ or oom, oom.memory)
        return EX_OUT_OF_MEMORY
    except (RuntimeError, MemoryError) as error:
        if not host_out_of_memory(error):
            raise
        record_oom(plan, rank, run.path, None, "outside a training step (start-up, evaluation, checkpoint or save)",
                   error, "host")
        return EX_OUT_OF_MEMORY


def _train(plan: RunPlan, run: RunDir, rank: Rank, preload: threading.Thread, stop: StopRequest) -> int:
    """The recipe once this rank is in its process group (`train`)."""
    import torch.distributed as dist

    from orchestrate.worker import stages
    from orchestrate.worker.loop import run_loop

    resume_from = stages.checkpoint_to_resume(plan, run, rank)  # checked before anything is built
    preload.join()  # before anything else touches transformers: its lazy modules are not thread-safe
    data = stages.build_data(plan, run, rank)  # first: a classifier's labels size its head
    plan = stages.resolve_steps(plan, data, resume_from)  # train.num_epochs as steps over this data, on every rank
    tensors = stages.count_tensors(rank)  # CPU: the live-tensor peak the memory verdict compares
    auxiliary = stages.build_auxiliary(plan, run, rank, data)  # before the trained model (see the function)
    engine, model_dir = stages.build_engine(plan, run, rank, data.label_names, auxiliary)
    checkpointer, start_step = stages.resume(plan, run, rank, engine, model_dir, data, resume_from)
    stages.release_start_up_cache(rank)
    training = Training(plan, rank, run, engine, data, checkpointer, stop, start_step)
    stopped = run_loop(training, stages.callbacks(plan, rank, data, start_step, resume_from), tensors)
    if not stopped:
        stages.save_model(plan, run, rank, engine, data)
    dist.barrier()
    dist.destroy_process_group()
    return EX_TEMPFAIL if stopped else 0


def name_this_rank() -> None:
    """`orchestrate-r<RANK>` in ps/top (the kernel's 15-byte process name): a rank forked by torchrun's
    agent has the agent's command line. Set once the stop handler is in (tests wait for the name)."""
    prctl(PR_SET_NAME, f"orchestrate-r{os.environ.get('RANK', '?')}".encode()[:15])


def main(argv: list[str] | None = None) -> int:
    guard_parent()
    stop = StopRequest().install()  # from here on SIGTERM/SIGUSR1 mean "checkpoint and exit"
    name_this_rank()
    from torch.distributed.elastic.multiprocessing.errors import record

    parser = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                     description="Train one rank of an orchestrate plan.")
    parser.add_argument("plan", type=Path, help="RUN_DIR/plan.json written by `orchestrate launch` or `config`")
    args = parser.parse_args(argv)
    if not args.plan.is_file():
        print(f"error: plan file {args.plan} not found", file=sys.stderr)
        return EXIT_USER_ERROR
    # @record writes the traceback of an unexpected error to torchrun's per-rank error file. Not of a
    # UserError or a lost peer: those are told in one line and are not crashes, and on a full disk
    # writing that file fails and leaves it empty, which torchrun's agent cannot parse.
    return record(_exit_code)(args.plan, stop)


def _exit_code(plan_path: Path, stop: StopRequest) -> int:
    """`train`, with a UserError or a lost peer as its exit code (any other error propagates)."""
    try:
        return train(plan_path, stop)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except Exception as exc:
        if not peer_lost(exc):
            raise
        print(f"error: lost contact with another rank, which stopped or died first ({str(exc).splitlines()[0]})",
              file=sys.stderr, flush=True)
        return EX_PEER_LOST


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted",
              "remote process exited")
"""What a collective raises when another rank's process is gone: gloo's tcp transport (pair.cc: "Read
error ... Connection reset by peer", after a kill -9 of the other rank) and NCCL's abort
messages (those not yet verified on a GPU)."""


def peer_lost(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_GONE)
