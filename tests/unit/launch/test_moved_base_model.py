"""A run's local base model that was moved or deleted is said to be gone from where it was (its
absolute path, from the run's config.yaml), at `--resume` before anything starts and where chat and
export re-read it, instead of being taken for a Hugging Face Hub id ("download the model")."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from orchestrate.config.load import config_from_dict
from orchestrate.errors import UserError
from orchestrate.model.meta import base_model_gone, load_model_config
from tests.helpers.cli import assert_one_message, invoke
from tests.helpers.plans import TINY_GPT2

GONE = "does not exist (moved or deleted?)"


@pytest.fixture
def moved_run(tmp_path) -> tuple[Path, Path, Path]:
    """(config path, run directory, where the base was): a run written with `launch --dry-run` from a
    local base at models/tiny (a name a Hub repo id could have), then the base moved away."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = tmp_path / "models" / "tiny"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_GPT2)).save_pretrained(base)
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"name_or_path": "models/tiny"},
        "train": {"seq_len": 32, "global_batch_size": 2, "max_steps": 2, "output_dir": "out"},
        "data": {"generate_demo_corpus": True}}))
    run = tmp_path / "run"
    result = invoke("launch", config, "--gpus", 1, "--dry-run", "--run-dir", run)
    assert result.exit_code == 0, result.output
    shutil.move(tmp_path / "models", tmp_path / "moved")
    return config, run, base


def test_resume_says_the_local_base_is_gone_and_where_it_was(moved_run):
    config, run, base = moved_run
    result = invoke("launch", config, "--resume", "--run-dir", run)
    assert_one_message(result, "model.name_or_path", f"{base} {GONE}", "put the model directory back")
    assert "Hub" not in result.output and "download" not in result.output


def test_chat_and_export_find_the_base_gone_without_asking_the_hub(moved_run, monkeypatch):
    """existing_weights_dir is how `chat` and `export --merge` re-read a LoRA run's frozen base."""
    from orchestrate.loading import init_weights
    from orchestrate.planner.plan import RunPlan

    _, run, base = moved_run
    monkeypatch.setattr(init_weights, "_hub_snapshot", lambda *a, **k: pytest.fail("looked up on the Hub"))
    with pytest.raises(UserError, match="the model directory is not there") as info:
        init_weights.existing_weights_dir(RunPlan.read(run / "plan.json"), run)
    assert f"{base} {GONE}" in str(info.value)


def test_a_base_still_there_or_a_hub_name_is_not_gone(moved_run, tmp_path):
    config, run, base = moved_run
    shutil.move(tmp_path / "moved", tmp_path / "models")
    plan_config = config_from_dict(yaml.safe_load(config.read_text()), tmp_path)
    assert base_model_gone(plan_config, run) is None
    hub = config_from_dict({"model": {"name_or_path": "org/name"}, "train": {"seq_len": 32, "global_batch_size": 2}},
                           tmp_path)
    assert base_model_gone(hub, tmp_path / "no-run") is None


def test_an_absolute_path_that_is_not_there_is_never_a_hub_id(tmp_path):
    config = config_from_dict({"model": {"name_or_path": str(tmp_path / "gone")},
                               "train": {"seq_len": 32, "global_batch_size": 2}}, tmp_path)
    with pytest.raises(UserError, match="the model directory is not there") as info:
        load_model_config(config)
    assert f"{tmp_path / 'gone'} {GONE}" in str(info.value)
