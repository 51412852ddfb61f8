"""Where the seconds before step 1 go: one `orchestrate launch` of the demo (tiny GPT-2, DDP, 2 ranks),
with a timestamp at each launcher phase and at each worker stage, all relative to the command's start.

The launcher's phases are its own functions wrapped in place (planning + run directory, data
preparation, the run through torchrun's agent); the agent process runs the same
`orchestrate.agent.process.main` through this file (`startup_stages.py agent LOG START REPLY_FD`), which
wraps its imports and the stages of `orchestrate.worker.stages` the same way before the ranks fork
from it (so they inherit the wrappers). Timestamps come from one clock (time.time) shared by all
processes of the machine. A table of one run, or with --repeats N the median (min-max) of each row
over N runs; nothing is compared here (`bench/overhead.py --only ddp` compares with accelerate launch).

Usage: .venv/bin/python bench/startup_stages.py [--repeats 3] [--gpus 2] [--short]   (--short: one run, CI)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "examples" / "tiny-gpt2.yaml"
STAGES = ("start_process_group", "checkpoint_to_resume", "build_data", "build_engine")


def _mark(log: Path, label: str, start: float) -> None:
    with log.open("a") as f:
        f.write(json.dumps({"label": label, "t": time.time() - start}) + "\n")


def _wrap(module, name: str, log: Path, start: float, prefix: str, only_rank0: bool = False) -> None:
    original = getattr(module, name)

    def timed(*args, **kwargs):
        if only_rank0 and os.environ.get("RANK") != "0":  # the ranks move together
            return original(*args, **kwargs)
        _mark(log, f"{prefix}{name} starts", start)
        out = original(*args, **kwargs)
        _mark(log, f"{prefix}{name} ends", start)
        return out

    setattr(module, name, timed)


def _agent(reply_fd: int, log: Path, start: float) -> int:
    """torchrun's agent, its imports and (rank 0's) worker stages timestamped."""
    _mark(log, "agent: interpreter up", start)
    import orchestrate.agent.process as process

    def imports(*args):
        _mark(log, "agent: imports start", start)
        process_import(*args)
        _mark(log, "agent: torch, transformers and the worker imported", start)
        import orchestrate.worker.stages as stages

        for name in STAGES:
            _wrap(stages, name, log, start, "rank 0: ", only_rank0=True)

    process_import, process.import_worker_code = process.import_worker_code, imports
    return process.main(reply_fd)


def _launcher(run_dir: Path, gpus: int, start: float) -> int:
    """`orchestrate launch --gpus N tiny-gpt2.yaml` (DDP, 3 steps) through the Python API, its phases
    timestamped and its agent started through this file."""
    import orchestrate.data.pipeline as pipeline
    import orchestrate.launch.session as session
    import orchestrate.transports.local.agent as warm_agent

    log = run_dir.parent / f"{run_dir.name}-launcher.jsonl"
    _mark(log, "launcher: interpreter up", start)
    # The agent's timestamps go to the same file (appends of one short line each).
    warm_agent.AGENT_PROGRAM = (str(Path(__file__).resolve()), "agent", str(log), repr(start))
    _wrap(session, "prepare_run_dir", log, start, "launcher: ")
    _wrap(pipeline, "prepare_for_plan", log, start, "launcher: ")
    _wrap(warm_agent.WarmAgent, "start", log, start, "launcher: agent ")
    _wrap(warm_agent.WarmAgent, "run", log, start, "launcher: agent ")
    from orchestrate import api
    from orchestrate.hardware.resolve import resolve_hardware

    config = api.load_config(CONFIG, ["train.max_steps=3", "train.eval_every=0", "strategy.backend=ddp",
                                      "strategy.zero_stage=0", f"data.cache_dir={run_dir.parent / 'data_cache'}"])
    return api.launch(api.launch_request(config, resolve_hardware(gpus=gpus), name="stages", run_dir=run_dir)).exit_code


def _one_run(out: Path, gpus: int, index: int) -> dict[str, float]:
    run_dir = out / f"run-{index}"
    start = time.time()
    with (out / f"run-{index}.log").open("w") as f:
        code = subprocess.call([sys.executable, str(Path(__file__).resolve()), "launcher", str(run_dir), str(gpus),
                                repr(start)], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if code != 0:
        sys.exit(f"the launch failed (exit {code}); see {out / f'run-{index}.log'}")
    marks = [json.loads(line) for line in (out / f"run-{index}-launcher.jsonl").read_text().splitlines()]
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    marks.append({"label": "step 1 ends (metrics.jsonl)", "t": first["time"] - start})
    return {m["label"]: m["t"] for m in sorted(marks, key=lambda m: m["t"])}


def main(argv: list[str] | None = None) -> int:
    from bench.repeats import spread

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=2, help="ranks (CPU processes without a GPU)")
    parser.add_argument("--short", action="store_true", help="one run (overrides --repeats)")
    args = parser.parse_args(argv)
    if args.short:
        args.repeats = 1
    out = Path(tempfile.mkdtemp(prefix="orchestrate-startup-"))
    runs = [_one_run(out, args.gpus, i) for i in range(args.repeats)]
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"seconds from the command's start, demo DDP on {args.gpus} ranks, median (min-max) "
                        f"of {args.repeats} runs ({out})")
    table.add_column("event")
    table.add_column("s", justify="right")
    for label in runs[0]:
        table.add_row(label, spread([r[label] for r in runs if label in r]).format(".2f"))
    Console().print(table)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "agent":  # agent LOG START REPLY_FD (the launcher adds the fd)
        sys.exit(_agent(int(sys.argv[4]), Path(sys.argv[2]), float(sys.argv[3])))
    elif len(sys.argv) > 1 and sys.argv[1] == "launcher":
        sys.exit(_launcher(Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
    else:
        sys.exit(main())
