"""launch_configs/ presets: regenerating them gives the same bytes, and real parsers accept them."""

from __future__ import annotations

import json

import pytest

from orchestrate.presets import LAUNCH_CONFIGS, PRESETS, render_preset


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_regenerating_a_preset_gives_the_committed_bytes(preset):
    rendered = render_preset(preset, f"launch_configs/{preset.name}")
    committed = {p.name: p.read_text() for p in (LAUNCH_CONFIGS / preset.name).iterdir()}
    assert rendered == committed, "run `python -m orchestrate.presets` and commit the result"


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_deepspeed_and_accelerate_accept_the_preset(preset, monkeypatch, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    folder = LAUNCH_CONFIGS / preset.name
    loaded = load_config_from_file(str(folder / "accelerate.yaml"))
    assert loaded.num_processes == preset.gpus
    ds_file = folder / "deepspeed.json"
    if ds_file.exists():
        from deepspeed.runtime import config as ds_config

        # DeepSpeedConfig reads rank and world size from deepspeed.comm; no process group needed.
        monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
        monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: preset.gpus)
        parsed = ds_config.DeepSpeedConfig(json.loads(ds_file.read_text()), mpu=None)
        assert parsed.zero_optimization_stage == preset.pins["strategy.zero_stage"]
        assert loaded.deepspeed_config["deepspeed_config_file"] == f"launch_configs/{preset.name}/deepspeed.json"
    else:
        settings = json.loads((folder / "fsdp.json").read_text())
        assert settings["fully_shard"]["reshard_after_forward"] is True  # zero_stage 3 = full shard
        assert settings["cpu_offload"] is True and settings["world_size"] == preset.gpus
        assert loaded.distributed_type == "FSDP"
        assert loaded.fsdp_config["fsdp_offload_params"] is True
