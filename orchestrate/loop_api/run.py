"""What torchrun runs on every rank for `orchestrate launch CONFIG -- PROGRAM`:

    python -m orchestrate.loop_api.run RUN_DIR/plan.json -- SCRIPT ARGS     (or -- -m MODULE ARGS)

Why an argument and not an environment variable: the plan stays the launcher's only channel
(docs/own-loop.md), what launch.sh shows is the whole story, and the script sees exactly the argv
it was given (`sys.argv == [SCRIPT, *ARGS]`), as if run by `python SCRIPT ARGS`.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from pathlib import Path

import orchestrate.loop_api.launch_state as launch_state
from orchestrate.errors import UserError
from orchestrate.run.exits import EXIT_USER_ERROR
from orchestrate.worker.orphans import guard_parent


def _usage() -> int:
    print(f"usage: python -m {__name__} RUN_DIR/plan.json -- SCRIPT ARGS | -m MODULE ARGS "
          "(started by `orchestrate launch CONFIG -- PROGRAM`)", file=sys.stderr)
    return EXIT_USER_ERROR


def run_program(plan_path: Path, program: list[str]) -> None:
    """Record the plan, then run `program` as `__main__` in this process (its exceptions propagate)."""
    launch_state.plan_path = plan_path.resolve()
    if program[0] == "-m":
        sys.argv = [program[1], *program[2:]]  # runpy puts the module's file in argv[0]
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(program)
        sys.path[0] = str(Path(program[0]).parent)  # what `python SCRIPT` puts first on the path
        runpy.run_path(program[0], run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--":
        return _usage()
    plan_path = Path(args[0])
    if not plan_path.is_file():
        print(f"error: plan file {plan_path} not found", file=sys.stderr)
        return EXIT_USER_ERROR
    guard_parent()  # a rank never outlives its launcher (orchestrate.worker.orphans)
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        # @record writes the traceback of an unexpected error to torchrun's per-rank error file.
        record(run_program)(plan_path, args[2:])
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr, flush=True)  # sys.exit("message"), as the interpreter would
        return 1
    return 0


def _finish() -> None:
    """Tear the process group down (the script may not have) and leave without C++ static
    destructors: see orchestrate/worker/__main__.py for the gloo abort at interpreter exit."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    code = main()
    _finish()
    os._exit(code)
