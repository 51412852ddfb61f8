"""The worker end to end on 2 gloo ranks: prepare_run + launch of a pinned-strategy plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orchestrate.launch.rundir import prepare_run
from orchestrate.launch.session import start
from orchestrate.planner.plan import RunPlan
from orchestrate.planner.strategy import Strategy
from orchestrate.transports.local.transport import LocalTorchrun
from tests.helpers.plans import make_plan

FSDP = Strategy("fsdp", 3, "none", "none", "fp32", False, 2)
DDP = Strategy("ddp", 0, "none", "none", "fp32", False, 2)
DEEPSPEED = Strategy("deepspeed", 2, "none", "none", "fp32", False, 2)

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "rss_peak_bytes_max_rank",
               "node_rss_peak_bytes", "predicted_gpu_bytes_per_rank", "predicted_cpu_bytes_per_node"}


def _run(tmp_path: Path, strategy: Strategy, **sections) -> tuple[int, Path]:
    config = {"train": {"max_steps": 12, "eval_every": 6, "seed": 0, "global_batch_size": 8,
                        "optimizer": {"lr": 3e-3}, "schedule": {"warmup_steps": 2}},
              "data": {"generate_demo_corpus": True}}
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    plan = make_plan(strategy, ranks=2, config=config, source_dir=tmp_path)
    run_dir = tmp_path / "run"
    return start(prepare_run(plan, run_dir), run_dir.resolve(), LocalTorchrun()).exit_code, run_dir


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [FSDP, DDP, DEEPSPEED], ids=["fsdp", "ddp", "deepspeed"])
def test_worker_trains_logs_metrics_and_saves_a_loadable_model(tmp_path: Path, strategy: Strategy):
    from transformers import AutoModelForCausalLM

    code, run_dir = _run(tmp_path, strategy)
    assert code == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert all(METRIC_KEYS <= r.keys() for r in records)
    assert [r["step"] for r in records if "eval_loss" in r] == [6, 12]
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-3:]) / 3
    assert first > 5.0 and last < first - 1.0, (first, last)  # ln(257) = 5.55 at the start
    assert records[-1]["eval_loss"] < records[5]["eval_loss"]
    assert all(r["rss_peak_bytes_max_rank"] > 50 * 2**20 for r in records)
    assert all(r["tokens_per_s"] > 0 and r["tokens"] == 8 * 32 for r in records)

    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    ids = torch.tensor([list(b"The cat sees the dog.")])
    with torch.no_grad():
        reloaded_loss = model(input_ids=ids, labels=ids).loss.item()
    assert reloaded_loss < 5.0  # trained, not the random initial model
    assert (run_dir / "init_model" / "config.json").is_file()


@pytest.mark.slow
def test_worker_reports_a_data_error_and_exits_2(tmp_path: Path):
    from orchestrate.errors import UserError
    from orchestrate.launch.session import launch_env

    (tmp_path / "docs.jsonl").write_text(json.dumps({"body": "no text field here"}) + "\n")
    with pytest.raises(UserError, match="'text'"):  # the launcher tokenises first and says so
        _run(tmp_path, FSDP, data={"train_files": ["docs.jsonl"], "generate_demo_corpus": False})
    # Workers started on the run directory directly (as a hand-run launch.sh does) say it too.
    run_dir = (tmp_path / "run").resolve()
    plan = RunPlan.read(run_dir / "plan.json")
    transport = LocalTorchrun()
    transport.prepare(plan, run_dir, launch_env(plan), max_restarts=0, dry_run=False)
    code = transport.run(plan, run_dir, print, None)
    assert code == 2
    stderr = "".join(p.read_text() for p in (run_dir / "logs").rglob("stderr.log"))
    assert "docs.jsonl" in stderr and "'text'" in stderr
    assert not (run_dir / "metrics.jsonl").exists()


def test_initial_weights_are_identical_for_the_same_seed(tmp_path: Path):
    from safetensors.torch import load_file

    from orchestrate.config.model import ModelSection
    from orchestrate.loading.init_weights import build_initial_model, ensure_initial_weights

    plan = make_plan(FSDP, ranks=1)
    a = ensure_initial_weights(plan, tmp_path / "a", local_rank=0)
    b = build_initial_model(plan, tmp_path / "b" / "init_model")
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(t.dtype == torch.float32 for t in wa.values())
    assert not list((tmp_path / "a").glob(".*tmp"))  # the temporary directory was renamed away
    # A model directory that already holds weights is used as is.
    plan.config.model = ModelSection(name_or_path=str(a))
    assert ensure_initial_weights(plan, tmp_path / "c", local_rank=0) == a


def test_ddp_builds_a_from_config_model_itself_with_the_weights_rank_0_would_have_saved(tmp_path: Path):
    """Backend.reads_weights: a DDP run from its config writes only config.json, and every rank's
    seeded build equals build_initial_model's saved weights (so no save + read back before step 1)."""
    from safetensors.torch import load_file

    from orchestrate.backends.registry import get_backend
    from orchestrate.loading.init_weights import (
        build_from_config,
        build_initial_model,
        ensure_initial_weights,
    )

    plan = make_plan(DDP, ranks=1)
    assert not get_backend("ddp").reads_weights(plan)
    assert get_backend("fsdp").reads_weights(plan) and get_backend("deepspeed").reads_weights(plan)
    config_only = ensure_initial_weights(plan, tmp_path / "a", local_rank=0, weights=False)
    assert [p.name for p in config_only.iterdir()] == ["config.json"]
    torch.manual_seed(plan.config.train.seed)  # as DDPBackend.setup does before building
    built = build_from_config(config_only, plan.config.model.task, trust_remote_code=False).state_dict()
    saved = load_file(build_initial_model(plan, tmp_path / "b" / "init_model") / "model.safetensors")
    assert saved.keys() <= built.keys() and all(torch.equal(built[k], saved[k]) for k in saved)
    # A backend that reads weights, later in the same run directory (a re-planned resume), gets them.
    assert ensure_initial_weights(plan, tmp_path / "a", local_rank=0) == config_only
    assert load_file(config_only / "model.safetensors").keys() == saved.keys()


def test_progress_prints_plain_lines_when_not_a_terminal(capsys):
    from orchestrate.worker.progress import ProgressDisplay

    shown = ProgressDisplay(max_steps=40, enabled=True, interactive=False)
    for step in range(1, 41):
        shown.update(step, loss=5.0 - step / 10, tokens_per_s=1000.0, eval_loss=1.5 if step == 5 else None)
    shown.close()
    lines = capsys.readouterr().out.splitlines()
    steps = [int(line.split()[1].split("/")[0]) for line in lines]
    assert steps == [1, 2, 4, 5, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40]
    assert "eval_loss 1.5000" in lines[3] and "loss 1.0000" in lines[-1]
    silent = ProgressDisplay(max_steps=40, enabled=False, interactive=False)  # ranks other than 0
    silent.update(1, 5.0, 1000.0)
    assert capsys.readouterr().out == ""


def test_ranks_from_slurm_and_a_clear_error_without_master(monkeypatch):
    from orchestrate.errors import UserError
    from orchestrate.worker.rank_start import environment_ranks

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # recorded, so monkeypatch restores what environment_ranks writes
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2(x2)")
    with pytest.raises(UserError, match="srun"):
        environment_ranks()
    monkeypatch.setenv("MASTER_ADDR", "node1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert environment_ranks() == (3, 1, 4, 2)
