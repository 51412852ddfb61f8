"""Damaged or absurd inputs are one message (exit 2, the file or flag named, a fix), never a
traceback: a truncated model.safetensors, a data cache whose tokens.bin was overwritten at its own
size with ids past the vocabulary, a garbage RUN_DIR/plan.json under --resume, a loss that is a
string in metrics.jsonl, a memory size no machine has. A launch refused on its data leaves no run
directory behind."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from orchestrate.errors import UserError
from tests.helpers.cli import assert_one_message, invoke
from tests.helpers.plans import TINY_GPT2

TRAIN = {"seq_len": 32, "global_batch_size": 8, "micro_batch_size": 2, "max_steps": 2}


def _yaml(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def truncated_model(tmp_path: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    model_dir = tmp_path / "model"
    GPT2LMHeadModel(GPT2Config(**{k: v for k, v in TINY_GPT2.items() if k != "model_type"})).save_pretrained(model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return model_dir


def test_a_truncated_model_safetensors_is_refused_before_any_worker(tmp_path: Path, truncated_model: Path):
    config = _yaml(tmp_path / "ft.yaml", {"model": {"name_or_path": str(truncated_model)}, "train": TRAIN,
                                          "data": {"generate_demo_corpus": True}})
    result = invoke("launch", "--gpus", 2, config, "--dry-run", "--run-dir", tmp_path / "run")
    assert_one_message(result, truncated_model / "model.safetensors", "damaged")
    assert not (tmp_path / "run").exists()


def test_a_truncated_model_safetensors_is_a_user_error_in_the_worker_too(truncated_model: Path):
    """Other transports start workers without this launcher's check (launch.sh, srun, SSH)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from orchestrate.backends.hf_io import StateLayout
    from orchestrate.loading.weights import plan_reads

    layout = StateLayout.of(GPT2LMHeadModel(GPT2Config(**{k: v for k, v in TINY_GPT2.items() if k != "model_type"})))
    with pytest.raises(UserError, match="cannot be read") as err:
        plan_reads(truncated_model, layout)
    assert "model.safetensors" in err.value.problems[0].where


def test_token_ids_past_the_vocabulary_in_the_data_cache_are_one_message(tmp_path: Path):
    cache = tmp_path / "cache"
    config = _yaml(tmp_path / "tiny.yaml", {"model": {"architecture": dict(TINY_GPT2)}, "train": TRAIN,
                                            "data": {"generate_demo_corpus": True, "cache_dir": str(cache)}})
    assert invoke("prepare", config).exit_code == 0
    [tokens] = cache.glob("demo_corpus-*/tokens.bin")
    ids = np.memmap(tokens, dtype=np.uint16, mode="r+")
    ids[:] = 60000  # same size, so every size check of the entry still passes
    ids.flush()
    del ids
    assert_one_message(invoke("prepare", config), tokens, "60,000", "orchestrate prepare CONFIG --force")


def test_a_garbage_plan_json_on_resume_is_one_message(tmp_path: Path):
    config = _yaml(tmp_path / "tiny.yaml", {"model": {"architecture": dict(TINY_GPT2)}, "train": TRAIN,
                                            "data": {"generate_demo_corpus": True}})
    run = tmp_path / "run"
    assert invoke("launch", "--gpus", 2, config, "--dry-run", "--run-dir", run).exit_code == 0
    (run / "plan.json").write_text("garbage{")
    result = invoke("launch", "--gpus", 2, config, "--resume", "--run-dir", run, "--dry-run")
    assert_one_message(result, run / "plan.json", "checkpoints/step-N/plan.json")


def test_a_loss_that_is_a_string_in_metrics_is_one_message_naming_the_record(tmp_path: Path):
    from tests.helpers.fake_runs import fake_run

    run = fake_run(tmp_path / "run")
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "loss": "nan-ish"}) + "\n")
    assert_one_message(invoke("report", run), "record 3 (step 3)", "loss is 'nan-ish'")


def test_a_memory_size_no_machine_has_is_refused_with_its_flag_or_yaml_path(tmp_path: Path):
    tiny = _yaml(tmp_path / "tiny.yaml", {"model": {"architecture": dict(TINY_GPT2)}, "train": TRAIN})
    result = invoke("plan", tiny, "--gpus", 2, "--gpu-mem", "99999999999999999999999999TiB")
    assert_one_message(result, "--gpu-mem", "e.g. 8GiB")
    profile = yaml.safe_load(invoke("profile", "--profile", "rtx3070", "--yaml").output)
    profile["gpu"]["memory_bytes"] = 10**40
    result = invoke("plan", tiny, "--profile", _yaml(tmp_path / "hw.yaml", profile))
    assert_one_message(result, "gpu.memory_bytes")


@pytest.mark.slow
def test_a_launch_refused_on_its_data_leaves_no_run_directory(tmp_path: Path):
    (tmp_path / "small.txt").write_text("hello world\n")  # 12 tokens: no block of 32 for either rank
    config = _yaml(tmp_path / "small.yaml", {"model": {"architecture": dict(TINY_GPT2)},
                                             "train": {**TRAIN, "output_dir": str(tmp_path / "runs")},
                                             "data": {"train_files": ["small.txt"]}})
    result = invoke("launch", "--gpus", 2, config)
    assert_one_message(result, "not enough training data", "fewer than the 2 ranks")
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["data_cache"]  # the shared cache stays
