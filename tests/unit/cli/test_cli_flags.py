"""CLI flag ranges: refused by click with exit 2 before anything runs."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from orchestrate.cli import cli


@pytest.mark.parametrize("command", ["launch", "slurm"])
def test_negative_max_restarts_is_refused(tmp_path, command):
    config = tmp_path / "model.yaml"
    config.write_text("model: {architecture: {model_type: gpt2}}\ntrain: {seq_len: 8, global_batch_size: 1}\n")
    result = CliRunner().invoke(cli, [command, str(config), "--max-restarts", "-1"])
    assert result.exit_code == 2, result.output
    assert "--max-restarts" in result.output and "-1" in result.output
