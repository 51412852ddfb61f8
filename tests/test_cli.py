"""The CLI through click's CliRunner: thin wrappers, clear errors with exit code 2, no tracebacks."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from orchestrate.cli import cli

EXAMPLES = __import__("pathlib").Path(__file__).parents[1] / "examples"


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
