"""The CLI through click's CliRunner: thin wrappers, clear errors with exit code 2, no tracebacks."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from orchestrate.cli import cli

EXAMPLES = __import__("pathlib").Path(__file__).parents[3] / "examples"


@pytest.fixture
def runner():
    return CliRunner()


def test_profile_preset_with_flags_prints_a_table_and_writes_yaml(runner, tmp_path):
    out = tmp_path / "hw.yaml"
    result = runner.invoke(cli, ["profile", "--profile", "rtx3070", "--gpus", "2", "--cpu-mem", "32GiB",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "RTX 3070" in result.output and "32.00 GiB" in result.output
    saved = yaml.safe_load(out.read_text())
    assert saved["gpus_per_node"] == 2 and saved["cpu_memory_bytes"] == 32 * 2**30
    again = runner.invoke(cli, ["profile", "--profile", str(out), "--yaml"])
    assert again.exit_code == 0 and yaml.safe_load(again.output)["gpus_per_node"] == 2


def test_profile_list_names_the_presets(runner):
    result = runner.invoke(cli, ["profile", "--list"])
    assert result.exit_code == 0
    assert {"rtx2070", "rtx3070", "cpu-only", "generic-8gb"} <= set(result.output.split())


@pytest.mark.parametrize("args, fragment", [
    (["profile", "--profile", "nope"], "no preset named 'nope'"),
    (["profile", "--gpu-mem", "8", "--gpus", "1"], "--gpu-mem"),
    (["profile", "--gpus", "0"], "--gpus"),
    (["profile", "--nodes", "-1"], "--nodes"),
])
def test_bad_hardware_flags_exit_2_without_traceback(runner, args, fragment):
    result = runner.invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert fragment in result.output
    assert "Traceback" not in result.output


def test_schema_lists_keys(runner):
    result = runner.invoke(cli, ["schema"])
    assert result.exit_code == 0
    assert "train.global_batch_size" in result.output


def test_plan_gpt2_xl_on_one_8gb_card_chooses_a_fitting_offload_plan(runner, tmp_path):
    result = runner.invoke(cli, ["plan", "--gpus", "1", "--gpu-mem", "8GiB", "--cpu-mem", "64GiB",
                                 str(EXAMPLES / "gpt2-xl.yaml"), "--json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["model"]["parameters"] == 1_557_611_200
    chosen = next(c for c in data["candidates"] if c["name"] == data["chosen"])
    assert chosen["fits"] and "offload" in chosen["name"]
    assert chosen["gpu_bytes_per_rank"] <= 0.9 * 8 * 2**30
    for c in data["candidates"]:
        assert {"name", "fits", "gpu_bytes_per_rank", "cpu_bytes_per_node", "tokens_per_s", "reason"} <= set(c)
        assert c["fits"] == (c["reason"] == "")
    assert json.loads((tmp_path / "plan.json").read_text())["chosen"] == data["chosen"]


def test_plan_7b_on_64gib_is_infeasible_naming_the_cpu_overflow(runner):
    result = runner.invoke(cli, ["plan", "--gpus", "1", "--gpu-mem", "8GiB", "--cpu-mem", "64GiB",
                                 str(EXAMPLES / "llama2-7b.yaml")])
    assert result.exit_code == 2
    assert "Nothing fits" in result.output and "overflows CPU RAM" in result.output
    assert "--nvme" in result.output and "Traceback" not in result.output


def test_plan_7b_becomes_feasible_with_an_nvme_profile(runner, tmp_path):
    # A profile file stands in for a machine with a large NVMe disk (free space is part of the profile).
    profile = tmp_path / "nvme-box.yaml"
    result = runner.invoke(cli, ["profile", "--profile", "generic-8gb", "--cpu-mem", "64GiB", "--yaml"])
    data = yaml.safe_load(result.output)
    data.update(nvme_path=str(tmp_path), nvme_free_bytes=2 * 2**40)
    profile.write_text(yaml.safe_dump(data))
    result = runner.invoke(cli, ["plan", "--profile", str(profile), "--gpus", "1",
                                 str(EXAMPLES / "llama2-7b.yaml"), "--json"])
    assert result.exit_code == 0, result.output
    assert "nvme" in json.loads(result.output)["chosen"]


def test_plan_bad_config_lists_every_problem_with_exit_2(runner, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name_or_path: ./nowhere}\ntrain: {seq_len: -1, global_batch_size: 8, colour: red}\n")
    result = runner.invoke(cli, ["plan", str(bad), "--gpus", "1"])
    assert result.exit_code == 2
    assert "train.seq_len (line 2)" in result.output and "train.colour (line 2)" in result.output
    assert "Traceback" not in result.output
    missing = tmp_path / "missing.yaml"
    missing.write_text("model: {name_or_path: ./nowhere}\ntrain: {seq_len: 8, global_batch_size: 8}\n")
    result = runner.invoke(cli, ["plan", str(missing), "--gpus", "1"])
    assert result.exit_code == 2 and "model.name_or_path" in result.output


def test_set_overrides_reach_the_plan(runner):
    result = runner.invoke(cli, ["plan", "--gpus", "2", str(EXAMPLES / "tiny-gpt2.yaml"), "--json",
                                 "--set", "strategy.backend=deepspeed", "--set", "strategy.zero_stage=2"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["chosen"].startswith("deepspeed-z2")


def test_launch_dry_run_writes_the_run_dir_and_prints_torchrun(runner, tmp_path):
    run_dir = tmp_path / "run"
    result = runner.invoke(cli, ["launch", "--gpus", "2", str(EXAMPLES / "tiny-gpt2.yaml"), "--dry-run",
                                 "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "torchrun" in result.output and "--nproc-per-node 2" in result.output
    assert (run_dir / "plan.json").is_file() and (run_dir / "config.yaml").is_file()
    assert not (run_dir / "metrics.jsonl").exists()  # nothing ran


def test_launch_infeasible_plan_exits_2_and_writes_nothing(runner, tmp_path):
    run_dir = tmp_path / "run"
    result = runner.invoke(cli, ["launch", "--gpus", "1", "--gpu-mem", "8GiB", "--cpu-mem", "64GiB",
                                 str(EXAMPLES / "llama2-7b.yaml"), "--run-dir", str(run_dir), "--dry-run"])
    assert result.exit_code == 2 and "Nothing fits" in result.output
    assert not run_dir.exists()


def test_config_writes_plan_and_rendered_files(runner, tmp_path):
    result = runner.invoke(cli, ["config", "--gpus", "2", str(EXAMPLES / "tiny-gpt2.yaml"), "--out", str(tmp_path),
                                 "--set", "strategy.backend=deepspeed"])
    assert result.exit_code == 0, result.output
    rendered = json.loads((tmp_path / "deepspeed.json").read_text())
    assert rendered["train_batch_size"] == 16 and "auto" not in json.dumps(rendered)
    assert (tmp_path / "accelerate.yaml").is_file() and (tmp_path / "plan.json").is_file()
