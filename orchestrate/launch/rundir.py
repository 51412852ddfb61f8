"""The run directory: everything a run is, readable and reusable by hand.

    RUN_DIR/
      config.yaml        the validated config, paths made absolute
      plan.json          the plan (Plan.write) plus a `run` section: worker environment and why
      <backend files>    what `get_backend(name).render(plan)` returned, e.g. deepspeed.json
      accelerate.yaml    the equivalent `accelerate launch` config, where the backend offers one
      data/              the generated demo corpus, when the config asks for it
      logs/              torchrun's per-rank stdout/stderr/error files
      launch.sh          the exact torchrun command (written at launch)
      metrics.jsonl      one JSON object per step (written by rank 0)
      init_model/        the seeded initial weights (written by the workers when training from scratch)
      model/             the trained Hugging Face model
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

from orchestrate.config.schema import RunConfig
from orchestrate.launch.nccl import nccl_env, nccl_rules
from orchestrate.planner.plan import Plan

PLAN_FILE = "plan.json"
CONFIG_FILE = "config.yaml"
LOG_DIR = "logs"
DEMO_CORPUS_FILE = "data/demo_corpus.txt"


def default_run_dir(config: RunConfig, name: str) -> Path:
    """`<train.output_dir>/<name>-<timestamp>`, with a numeric suffix if that exists already."""
    base = config.resolve_path(config.train.output_dir) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
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
    if d["tokenizer"]:
        d["tokenizer"] = absolute(d["tokenizer"])
    if d.get("cache_dir"):
        d["cache_dir"] = absolute(d["cache_dir"])
    if d.get("dataset") and config.resolve_path(d["dataset"]).exists():  # a local path, not a Hub name
        d["dataset"] = absolute(d["dataset"])
    data["train"]["output_dir"] = absolute(data["train"]["output_dir"])
    if data["strategy"]["nvme_path"]:
        data["strategy"]["nvme_path"] = absolute(data["strategy"]["nvme_path"])
    name = data["model"]["name_or_path"]
    if name and config.resolve_path(name).exists():
        data["model"]["name_or_path"] = absolute(name)
    return data


def worker_env(plan: Plan) -> tuple[dict[str, str], list[str]]:
    """Environment for the libraries under the workers (never orchestrate settings) and why."""
    env, notes = nccl_env(plan.hardware), [rule.reason for rule in nccl_rules(plan.hardware)]
    if not plan.hardware.has_gpu:
        # torchrun would set 1 thread per process; give the CPU workers the cores they share.
        threads = max(1, plan.hardware.cpu_cores // plan.hardware.ranks_per_node)
        env["OMP_NUM_THREADS"] = str(threads)
    return env, notes


def write_plan(plan: Plan, path: Path, run_info: dict[str, Any]) -> Path:
    """Plan.write's file plus the `run` section (Plan.read ignores it; `read_run_info` returns it)."""
    data = plan.to_dict()
    data["run"] = run_info
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)  # atomic, as Plan.write
    return path


def read_run_info(plan_path: Path) -> dict[str, Any]:
    return json.loads(Path(plan_path).read_text()).get("run", {})


ACCELERATE_FILE = "accelerate.yaml"


def prepare_run(plan: Plan, run_dir: Path) -> Plan:
    """Write the run directory for a feasible plan; returns the plan with `files` filled in."""
    from orchestrate.backends.accelerate_export import render_accelerate_config
    from orchestrate.backends.base import get_backend
    from orchestrate.data.corpus import write_demo_corpus
    from orchestrate.data.pipeline import DEMO_CORPUS_ROLE

    if plan.chosen is None:  # callers check feasibility first (planner.search.require_feasible)
        raise ValueError("prepare_run needs a plan with a chosen strategy")
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOG_DIR).mkdir(exist_ok=True)
    config = plan.config
    files: dict[str, str] = {"config": CONFIG_FILE, "logs": LOG_DIR, "metrics": "metrics.jsonl", "model_out": "model"}

    header = (f"# The validated config of this run (paths made absolute; originally from "
              f"{config.source_dir or 'an in-memory config'}).\n")
    (run_dir / CONFIG_FILE).write_text(header + yaml.safe_dump(resolved_config_dict(config), sort_keys=False))

    rendered = get_backend(plan.chosen.strategy.backend).render(plan)
    for i, (name, text) in enumerate(rendered.items()):
        (run_dir / name).write_text(text)
        files["backend_config" if i == 0 else f"backend_config:{name}"] = name
    (run_dir / ACCELERATE_FILE).write_text(render_accelerate_config(plan, run_dir))
    files["accelerate_config"] = ACCELERATE_FILE

    if config.data.generate_demo_corpus and not config.data.train_files:
        write_demo_corpus(run_dir / DEMO_CORPUS_FILE, config.train.seed)
        files[DEMO_CORPUS_ROLE] = DEMO_CORPUS_FILE

    plan.files = files
    env, notes = worker_env(plan)
    write_plan(plan, run_dir / PLAN_FILE, {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                           "env": env, "env_notes": notes})
    return plan
