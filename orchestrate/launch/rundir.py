"""Writing a run directory (its layout is the contract in `orchestrate.run`): plan or resume,
check (nothing is written before: a refused launch or resume leaves the directory untouched), take
the lock, then write the marker first, config.yaml, the rendered backend configs, accelerate.yaml,
the demo corpus and plan.json (with its run section) last."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import yaml

from orchestrate.backends.accelerate_export import render_accelerate_config
from orchestrate.backends.registry import get_backend
from orchestrate.config.schema import RunConfig
from orchestrate.data.sources import is_hub_name
from orchestrate.errors import Problem, UserError
from orchestrate.hardware.alloc_conf import launch_alloc_env
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.launch.nccl import nccl_env, nccl_rules
from orchestrate.launch.resume import plan_for_resume, refuse_checkpointed, resume_notice, run_to_resume
from orchestrate.loading.weight_files import check_model_weights
from orchestrate.methods.registry import method_data
from orchestrate.planner.plan import Refusal, RunFiles, RunPlan, RunSection
from orchestrate.planning import feasible_plan
from orchestrate.run.checkpoints import list_checkpoints
from orchestrate.run.layout import (
    ACCELERATE_FILE,
    CONFIG_FILE,
    DEMO_CORPUS_FILE,
    LAUNCH_SCRIPT,
    LOCK_FILE,
    LOG_DIR,
    MARKER_FILE,
    METRICS_FILE,
    MODEL_DIR,
    PLAN_FILE,
    REQUEUE_FILE,
    check_no_links,
    check_run_dir_writable,
    os_errors_as_user_errors,
    write_marker,
)
from orchestrate.run.lock import RunLock

RUN_DIR_OWN_FILES = (MARKER_FILE, LOCK_FILE, REQUEUE_FILE)
"""Written into any run directory besides `run_dir_writes`, marked or not."""


def default_run_dir(config: RunConfig, name: str) -> Path:
    """`<train.output_dir>/<name>-<timestamp>`, with a numeric suffix if that exists already."""
    base = config.output_root() / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def resolved_config_dict(config: RunConfig) -> dict[str, Any]:
    """The config as plain data with every user path absolute, so config.yaml works from anywhere."""
    data = config.model_dump(mode="json")

    def absolute(p: str) -> str:
        return str(config.resolve_path(p).resolve())

    d = data["data"]
    d["train_files"] = [absolute(p) for p in d["train_files"]]
    d["validation_files"] = [absolute(p) for p in d["validation_files"]]
    for entry in d["datasets"]:  # a local path (or pattern); a dataset name stays a name
        if not is_hub_name(entry["path"]) or config.resolve_path(entry["path"]).exists():
            entry["path"] = absolute(entry["path"])
    if d["tokenizer"]:
        d["tokenizer"] = absolute(d["tokenizer"])
    if d.get("cache_dir"):
        d["cache_dir"] = absolute(d["cache_dir"])
    if d.get("dataset") and config.resolve_path(d["dataset"]).exists():  # a local path, not a Hub name
        d["dataset"] = absolute(d["dataset"])
    data["train"]["output_dir"] = str(config.output_root().resolve())
    if data["strategy"]["nvme_path"]:
        data["strategy"]["nvme_path"] = absolute(data["strategy"]["nvme_path"])
    name = data["model"]["name_or_path"]
    if name and config.resolve_path(name).exists():
        data["model"]["name_or_path"] = absolute(name)
    return data


def worker_env(plan: RunPlan) -> tuple[dict[str, str], list[str]]:
    """Environment for the libraries under the workers (never orchestrate settings) and why."""
    env, notes = nccl_env(plan.hardware), [f"NCCL: {rule.reason}" for rule in nccl_rules(plan.hardware)]
    if plan.hardware.has_gpu:
        alloc, why = launch_alloc_env(plan.hardware.expandable_segments, os.environ)
        env.update(alloc)
        notes.append(why)
    else:
        # torchrun would set 1 thread per process; give the CPU workers the cores they share.
        threads = max(1, plan.hardware.cpu_cores // plan.hardware.ranks_per_node)
        env["OMP_NUM_THREADS"] = str(threads)
        # Every worker imports DeepSpeed (transformers' save_pretrained looks for its engine); told
        # there is no GPU, it does not warn that it found none (deepspeed/accelerator/real_accelerator.py).
        env["DS_ACCELERATOR"] = "cpu"
    return env, notes


def prepare_run(plan: RunPlan, run_dir: Path, rendered: dict[str, str] | None = None) -> RunPlan:
    """Write the run directory for a feasible plan; returns the plan with `files` and `run` filled
    in. An OS error (read-only directory, full disk) is a UserError naming the path. `rendered`:
    the backend's config files when the caller has them already."""
    run_dir = run_dir.resolve()
    with os_errors_as_user_errors("--run-dir"):
        run_dir.mkdir(parents=True, exist_ok=True)
        write_marker(run_dir)
        return _write_run_files(plan, run_dir, rendered)


def _write_run_files(plan: RunPlan, run_dir: Path, rendered: dict[str, str] | None) -> RunPlan:
    from orchestrate.data.corpus import write_demo_corpus

    (run_dir / LOG_DIR).mkdir(exist_ok=True)
    config = plan.config
    files = RunFiles(config=CONFIG_FILE, logs=LOG_DIR, metrics=METRICS_FILE, model_out=MODEL_DIR)

    header = (f"# The validated config of this run (paths made absolute; originally from "
              f"{config.source_dir or 'an in-memory config'}).\n")
    (run_dir / CONFIG_FILE).write_text(header + yaml.safe_dump(resolved_config_dict(config), sort_keys=False))

    if rendered is None:  # prepare_run_dir rendered them already, to check what would be replaced
        rendered = get_backend(plan.strategy.backend).render(plan)
    for name, text in rendered.items():
        (run_dir / name).write_text(text)
        files.backend.append(name)
    (run_dir / ACCELERATE_FILE).write_text(render_accelerate_config(plan, run_dir))
    files.accelerate_config = ACCELERATE_FILE

    if config.data.generate_demo_corpus and not (config.data.train_files or config.data.datasets):
        write_demo_corpus(run_dir / DEMO_CORPUS_FILE, config.train.seed)
        files.demo_corpus = DEMO_CORPUS_FILE

    plan.files = files
    env, notes = worker_env(plan)
    plan.run = RunSection(created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), env=env, env_notes=notes)
    plan.write(run_dir / PLAN_FILE)
    return plan


def write_plan_dir(plan: RunPlan | Refusal, out: Path) -> Path:
    """`orchestrate plan --out DIR`: DIR/plan.json, with the rules of a run directory (the marker, the
    lock): never over a plan.json orchestrate did not write, never into a run that has checkpoints
    (its plan.json is what --resume continues with)."""
    out = Path(out).resolve()
    check_run_dir_writable(out, [PLAN_FILE], plan.config.source_dir, where="--out")
    check_no_links(out, [PLAN_FILE, *RUN_DIR_OWN_FILES])
    if list_checkpoints(out):
        raise UserError("the --out directory is a run with checkpoints", [Problem(
            "--out", f"{out} holds {', '.join(p.name for p in list_checkpoints(out)[-3:])}; its plan.json is "
            "the one --resume continues with", "give a new directory: --out NEW")])
    with lock_run_dir(out, "orchestrate plan --out"), os_errors_as_user_errors("--out"):
        write_marker(out)
        return plan.write(out / PLAN_FILE)


def run_dir_writes(rendered: dict[str, str]) -> list[str]:
    """The names `prepare_run` and the launch write into a run directory (`rendered`: the
    backend's config files)."""
    names = [CONFIG_FILE, PLAN_FILE, ACCELERATE_FILE, LAUNCH_SCRIPT, LOG_DIR, METRICS_FILE, MODEL_DIR,
             DEMO_CORPUS_FILE]
    return names + list(rendered)


def lock_run_dir(run_dir: Path, what: str, remote_workers: bool = False) -> RunLock:
    """The run directory's lock (created with the directory); UserError naming the holder."""
    with os_errors_as_user_errors("--run-dir"):
        run_dir.mkdir(parents=True, exist_ok=True)
    return RunLock.acquire(run_dir, what, remote_workers)


def prepare_run_dir(config: RunConfig, hardware: HardwareProfile, name: str, run_dir: Path | None, resume: bool,
                    say: Callable[[str], None], check: Callable[[RunPlan], None] | None = None, *,
                    force: bool = False, hold: ExitStack | None = None, remote_workers: bool = False,
                    where: str = "--run-dir", check_data: bool = True) -> tuple[RunPlan, Path]:
    """Plan (UserError when nothing fits), check the data, run `check` on the plan, check that the
    directory may be written (orchestrate.run.layout; `force`), then lock it and write it;
    notices (resuming) go to `say`. With `resume`, `run_dir` (default: the newest run of `name`)
    keeps its own plan when it still fits and is not written again (`orchestrate.launch.resume`);
    otherwise a `run_dir` that already holds checkpoints is refused. The lock is kept in `hold`
    (the caller's, for the whole launch), else released once written. Every command that writes a
    run directory (config, launch, slurm) comes through here. Returns the plan and the run directory.
    `check_data=False`: the user's own program brings its data (launch -- python train.py)."""
    from orchestrate.data.pipeline import check_data_config

    rendered = None
    if resume:
        run_dir = run_to_resume(config, name, run_dir)
        plan, reused, found, changes = plan_for_resume(config, hardware, run_dir)
    else:
        plan, reused = feasible_plan(config, hardware), False
        run_dir = (run_dir or default_run_dir(config, name)).resolve()
        rendered = get_backend(plan.strategy.backend).render(plan)
        check_run_dir_writable(run_dir, run_dir_writes(rendered), config.source_dir, force, where)
        refuse_checkpointed(run_dir)
    check_model_weights(plan.config)
    if check_data:
        check_data_config(plan.config, plan.shape.max_position_embeddings, plan.shape.vocab_size,
                          method_data(plan.config))
    if check is not None:
        check(plan)
    check_no_links(run_dir, run_dir_writes(rendered or {}) + list(RUN_DIR_OWN_FILES))
    with ExitStack() as own:
        lock: AbstractContextManager = lock_run_dir(run_dir, f"orchestrate {name}", remote_workers)
        (hold if hold is not None else own).enter_context(lock)
        if resume:
            say(resume_notice(run_dir, reused, found, changes))
        return (plan if reused else prepare_run(plan, run_dir, rendered)), run_dir
