"""The launcher: run directory, exact torchrun command, rendezvous defaults, NCCL rules; one real launch."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from orchestrate import api
from orchestrate.config.load import load_config
from orchestrate.errors import UserError
from orchestrate.hardware.profile import GPUSpec, HardwareProfile
from orchestrate.launch.nccl import nccl_env, nccl_rules
from orchestrate.launch.rundir import default_run_dir, worker_env
from orchestrate.launch.torchrun_args import LaunchOptions, torchrun_argv
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import PLAN_FILE
from tests.helpers.plans import cpu_hardware

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny-gpt2.yaml"


def _tiny(*overrides: str):
    return load_config(TINY, list(overrides))


def launch_from_config(config, hardware: HardwareProfile, **kwargs):
    return api.launch(api.launch_request(config, hardware, **kwargs))


def _dry_run(tmp_path: Path, *overrides: str, hardware: HardwareProfile | None = None, **kwargs):
    config = _tiny(f"train.output_dir={tmp_path}", *overrides)
    return launch_from_config(config, hardware or cpu_hardware(2), name="tiny-gpt2", dry_run=True, **kwargs)


def test_dry_run_writes_the_run_dir_and_starts_nothing(tmp_path: Path):
    result = _dry_run(tmp_path)
    run_dir = result.run_dir
    assert result.exit_code is None
    assert run_dir.parent == tmp_path and run_dir.name.startswith("tiny-gpt2-")
    plan = RunPlan.read(run_dir / PLAN_FILE)
    files = plan.files
    assert files.config == "config.yaml" and files.backend and files.accelerate_config and files.demo_corpus
    for name in (files.config, *files.backend, files.accelerate_config, files.demo_corpus):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "launch.sh").read_text().strip().endswith(result.command)
    # Nothing ran: no worker output, no metrics, no weights.
    assert (run_dir / "logs").is_dir() and not any((run_dir / "logs").iterdir())
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "init_model").exists()
    assert "--nproc-per-node 2" in result.command
    assert f"-m orchestrate.worker {run_dir / PLAN_FILE}" in result.command
    assert any("No GPU" in m and "gloo" in m for m in result.messages)
    # The resolved config.yaml loads back to the same config.
    again = load_config(run_dir / "config.yaml")
    assert again.model_dump() == plan.config.model_dump()


def test_dry_run_command_is_what_torchrun_parses(tmp_path: Path):
    from torch.distributed.run import parse_args

    result = _dry_run(tmp_path, run_dir=tmp_path / "exact")
    words = shlex.split(result.command)
    env = {w.split("=")[0]: w.split("=", 1)[1] for w in words[: words.index("torchrun")]}
    # 2 cores, 2 ranks; DeepSpeed told there is no GPU (no "Setting accelerator to CPU" warning)
    assert RunPlan.read(result.plan_path).run.env == {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    # torchrun's own shutdown settings (session.launch_env): wait train.preemption_grace_s for
    # the workers' checkpoint on SIGTERM, and forward SIGUSR1 too; a fresh store per restart.
    assert env == {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120",
                   "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    args = parse_args(words[words.index("torchrun") + 1 :])
    assert (args.nproc_per_node, args.nnodes, args.module) == ("2", "1", True)
    assert (args.training_script, args.training_script_args) == ("orchestrate.worker", [str(result.plan_path)])
    # One node: torchrun's static rendezvous on a free local port (torchrun_args.py says why not c10d).
    assert args.log_dir == str(tmp_path / "exact" / "logs") and args.rdzv_backend == "static"
    assert args.local_addr == "127.0.0.1"  # where rank 0 hosts the workers' store
    assert args.master_addr == "127.0.0.1" and int(args.master_port) > 0


def test_infeasible_plan_is_a_user_error_before_anything_is_written(tmp_path: Path):
    small = HardwareProfile(name="tiny", gpus_per_node=0, cpu_processes=2, cpu_memory_bytes=2**30, cpu_cores=2)
    config = load_config(ROOT / "examples" / "llama2-7b.yaml", [f"train.output_dir={tmp_path}"])
    with pytest.raises(UserError):
        launch_from_config(config, small, name="big", dry_run=True)
    assert not any(tmp_path.iterdir())


def test_bad_data_is_reported_before_workers_start(tmp_path: Path):
    with pytest.raises(UserError) as err:
        _dry_run(tmp_path, "data.train_files=[missing.txt]", "train.seq_len=512")
    assert {p.where for p in err.value.problems} == {"data.train_files[0]", "train.seq_len"}


def test_free_port_by_default_and_explicit_port(tmp_path: Path):
    plan = _dry_run(tmp_path).plan
    path = tmp_path / "plan.json"
    argvs = [torchrun_argv(plan, path, LaunchOptions(), tmp_path) for _ in range(3)]
    assert all(" ".join(a).startswith("--nnodes 1 --nproc-per-node 2 --rdzv-backend static --master-addr 127.0.0.1 "
                                      "--master-port ") for a in argvs)
    ports = {argv[argv.index("--master-port") + 1] for argv in argvs}
    assert "29500" not in ports
    fixed = torchrun_argv(plan, path, LaunchOptions(master_port=29999), tmp_path)
    assert fixed[fixed.index("--master-port") + 1] == "29999"
    # Restarts, or c10d asked for by name: torchrun's c10d rendezvous, on a free (or the given) local port.
    restarts = torchrun_argv(plan, path, LaunchOptions(master_port=29999, max_restarts=2), tmp_path)
    assert "127.0.0.1:29999" in restarts and restarts[restarts.index("--max-restarts") + 1] == "2"
    c10d = torchrun_argv(plan, path, LaunchOptions(rdzv_backend="c10d"), tmp_path)
    for argv in (restarts, c10d):
        assert argv[argv.index("--rdzv-backend") + 1] == "c10d" and argv[argv.index("--rdzv-endpoint") + 1].startswith("127.0.0.1:")


def test_multi_node_rendezvous_options(tmp_path: Path):
    plan = _dry_run(tmp_path).plan
    plan.hardware = plan.hardware.model_copy(update={"nodes": 2})
    path = tmp_path / "plan.json"
    with pytest.raises(UserError, match="rendezvous"):
        torchrun_argv(plan, path, LaunchOptions(), tmp_path)
    c10d = torchrun_argv(plan, path, LaunchOptions(rdzv_endpoint="head:29400", rdzv_id="job7"), tmp_path)
    assert " ".join(c10d).startswith("--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d "
                                     "--rdzv-endpoint head:29400 --rdzv-id job7")
    with pytest.raises(UserError, match="rank"):
        torchrun_argv(plan, path, LaunchOptions(master_addr="head"), tmp_path)
    static = torchrun_argv(plan, path, LaunchOptions(master_addr="head", node_rank=1), tmp_path)
    assert "--node-rank 1 --master-addr head --master-port 29500" in " ".join(static)
    with pytest.raises(UserError, match="node count"):
        torchrun_argv(plan, path, LaunchOptions(nnodes=3, rdzv_endpoint="head:1"), tmp_path)


def test_default_run_dir_is_stem_and_timestamp_and_never_reused(tmp_path: Path):
    config = _tiny(f"train.output_dir={tmp_path / 'runs'}")
    first = default_run_dir(config, "tiny-gpt2")
    first.mkdir(parents=True)
    second = default_run_dir(config, "tiny-gpt2")
    assert first.parent == second.parent == tmp_path / "runs" and second != first
    assert second.name.startswith(first.name)


def _gpus(name: str, count: int, driver: str | None) -> HardwareProfile:
    spec = GPUSpec(name=name, memory_bytes=24 * 2**30, peak_tflops_fp16=165, peak_tflops_bf16=165,
                   peak_tflops_fp32=82)
    return HardwareProfile(gpus_per_node=count, gpu=spec, cpu_memory_bytes=64 * 2**30, driver_version=driver)


@pytest.mark.parametrize(("name", "count", "driver", "disabled"), [
    ("NVIDIA GeForce RTX 4090", 2, "535.104.05", True),
    ("NVIDIA GeForce RTX 4090", 2, "550.40.06", True),
    ("NVIDIA GeForce RTX 4090", 2, None, True),  # unknown driver: play safe
    ("NVIDIA GeForce RTX 4090", 2, "550.40.07", False),
    ("NVIDIA GeForce RTX 4070 Ti", 4, "560.35.03", False),
    ("NVIDIA GeForce RTX 4090", 1, "535.104.05", False),  # one card: no peer traffic
    ("NVIDIA GeForce RTX 3090", 2, "535.104.05", False),
    ("NVIDIA A100-SXM4-80GB", 8, "470.57.02", False),
])
def test_nccl_rule_table(name: str, count: int, driver: str | None, disabled: bool):
    env = nccl_env(_gpus(name, count, driver))
    expected = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"} if disabled else {}
    assert env == expected
    assert bool(nccl_rules(_gpus(name, count, driver))) == disabled


def test_runs_go_under_the_working_directory_not_beside_the_config(tmp_path: Path, monkeypatch):
    import shutil

    from click.testing import CliRunner

    from orchestrate.cli import cli

    (tmp_path / "configs").mkdir()
    config = shutil.copy(TINY, tmp_path / "configs" / "tiny-gpt2.yaml")  # as examples/ holds it: no output_dir
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    result = CliRunner().invoke(cli, ["launch", "--gpus", "2", str(config), "--dry-run"])
    assert result.exit_code == 0, result.output
    (run_dir,) = (tmp_path / "work" / "runs").glob("tiny-gpt2-*")
    assert (run_dir / PLAN_FILE).is_file() and not (tmp_path / "configs" / "runs").exists()
    assert RunPlan.read(run_dir / PLAN_FILE).config.train.output_dir == str(tmp_path.resolve() / "work" / "runs")
    # A relative path written in the YAML (or set) is the YAML's, as every path in it is.
    result = CliRunner().invoke(cli, ["launch", "--gpus", "2", str(config), "--dry-run", "--set", "train.output_dir=out"])
    assert result.exit_code == 0, result.output
    assert list((tmp_path / "configs" / "out").glob("tiny-gpt2-*"))


def test_nccl_env_is_recorded_in_the_plan_and_cpu_runs_need_none():
    assert nccl_env(cpu_hardware(2)) == {}


def test_worker_env_shares_the_cores_between_cpu_ranks(tmp_path: Path):
    plan = _dry_run(tmp_path).plan
    plan.hardware = plan.hardware.model_copy(update={"cpu_cores": 16, "cpu_processes": 4})
    assert worker_env(plan) == ({"OMP_NUM_THREADS": "4", "DS_ACCELERATOR": "cpu"}, [])


@pytest.mark.slow
def test_real_launch_of_the_demo_config_completes(tmp_path: Path):
    config = _tiny(f"train.output_dir={tmp_path}", "train.max_steps=3", "train.eval_every=0",
                   "train.seq_len=64", "train.global_batch_size=4")
    result = launch_from_config(config, cpu_hardware(2), name="tiny-gpt2", run_dir=tmp_path / "run")
    assert result.exit_code == 0, result.messages
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and "eval_loss" in lines[-1]
    assert (tmp_path / "run" / "model" / "config.json").is_file()
    # Every rank's output is kept; rank 0 ran too (its file has the final summary).
    logs = list((tmp_path / "run" / "logs").rglob("stdout.log"))
    assert len(logs) == 2
    assert any("done. model:" in p.read_text() for p in logs)


def test_config_runs_the_checks_launch_runs(tmp_path: Path):
    """`orchestrate config` writes what `launch` would, after the same data and checkpoint checks."""
    bad = _tiny(f"train.output_dir={tmp_path}", "data.train_files=[missing.txt]", "train.seq_len=512")
    with pytest.raises(UserError) as config_err:
        api.write_config(bad, cpu_hardware(2), tmp_path / "out")
    with pytest.raises(UserError) as launch_err:
        launch_from_config(bad, cpu_hardware(2), dry_run=True, run_dir=tmp_path / "run")
    assert config_err.value.problems == launch_err.value.problems
    assert not (tmp_path / "out").exists()

    out = tmp_path / "written"
    plan = api.write_config(_tiny(f"train.output_dir={tmp_path}"), cpu_hardware(2), out)
    assert RunPlan.read(out / PLAN_FILE).chosen.name == plan.chosen.name
    (out / "checkpoints" / "step-00000002").mkdir(parents=True)
    (out / "checkpoints" / "step-00000002" / "meta.json").write_text("{}")
    (out / "checkpoints" / "latest").write_text("step-00000002")
    with pytest.raises(UserError, match="--resume"):
        api.write_config(_tiny(f"train.output_dir={tmp_path}"), cpu_hardware(2), out)


def test_dry_run_and_config_import_no_heavy_library(tmp_path: Path):
    """What must come before torchrun starts (plan, render, run directory) stays light."""
    from tests.helpers.imports import run_cli

    dry = run_cli("launch", "--gpus", "2", str(TINY), "--run-dir", str(tmp_path / "run"), "--dry-run")
    assert (dry.code, dry.heavy) == (0, []), dry.output
    written = run_cli("config", "--gpus", "2", str(TINY), "--out", str(tmp_path / "cfg"))
    assert (written.code, written.heavy) == (0, []), written.output
