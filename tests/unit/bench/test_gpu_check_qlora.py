"""The QLoRA entries of bench/gpu_check.py on CPU: the random bf16 base (bench/random_base.py) loads
as written, quantized as it loads; the Llama-3-8B entry's seq_len search; and (slow) a QLoRA entry's
whole path — base written, launched through the capping worker, metrics read — with a tiny base."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from bench import gpu_check, qlora_zoo, random_base

TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 128,
        "tie_word_embeddings": False}
GiB = 2**30


def test_shards_keep_state_dict_order_under_the_limit(monkeypatch):
    monkeypatch.setattr(random_base, "SHARD_BYTES", 100)
    shapes = {"a": (10,), "b": (20,), "c": (60,), "d": (5,)}  # 2-byte elements: 20, 40, 120, 10 bytes
    assert random_base._shards(shapes, 2) == [["a", "b"], ["c"], ["d"]]  # c alone: bigger than a shard


def test_random_base_loads_as_written_and_quantizes_as_it_loads(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from orchestrate.methods.lora.quantized_loading import load_quantized
    from tests.methods.lora.test_quantized_loading import qlora_plan

    monkeypatch.setattr(random_base, "SHARD_BYTES", 64 * 1024)  # several shards for a 0.1M-param model
    out = random_base.write_config(TINY, tmp_path / "base")
    assert not list(out.glob("*.safetensors"))  # config only: what a dry run plans from
    index = random_base.write_weights(out, seed=0)
    weight_map = json.loads(index.read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert set(weight_map) == set(model.state_dict())
    state = model.state_dict()
    assert all(state[k].dtype == torch.bfloat16 for k in state)
    assert torch.equal(state["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    q = state["model.layers.0.self_attn.q_proj.weight"].float()
    assert abs(q.mean().item()) < 0.003 and q.std().item() == pytest.approx(0.02, rel=0.1)  # N(0, 0.02)
    assert not torch.equal(q, state["model.layers.1.self_attn.q_proj.weight"].float())
    mtime = index.stat().st_mtime_ns
    assert random_base.write_weights(out, seed=0) == index and index.stat().st_mtime_ns == mtime  # reused
    quantized, _ = load_quantized(out, torch.device("cpu"), qlora_plan(TINY))
    assert sum("weight.absmax" in k for k in quantized.state_dict()) == 2 * 7  # every block linear NF4


def test_a_tied_model_is_refused(tmp_path):
    out = random_base.write_config({**TINY, "tie_word_embeddings": True}, tmp_path / "tied")
    with pytest.raises(ValueError, match="untied"):
        random_base.write_weights(out)


def test_the_8b_entry_takes_the_longest_seq_len_that_fits(tmp_path):
    """examples/llama3-8b.yaml with method qlora on the 8 GiB card: seq 4096, the first tried, on DDP with
    every memory knob a DDP rank runs (activation and embedding offload, the loss in 16 chunks, the MLP in
    4 tiles: without the tiles DDP does not fit 4096 beside the CUDA context measured on a GPU, and ZeRO-3
    with the base and optimizer in host memory is slower); a 3 GiB card falls back further (each seq_len
    tried is recorded)."""
    from orchestrate.hardware.resolve import resolve_hardware

    base = json.loads(json.dumps(gpu_check.BASE))
    base["train"]["output_dir"] = str(tmp_path)
    hw = resolve_hardware(profile="rtx3070", gpus=1, gpu_mem="8GiB")
    cfg, tried = qlora_zoo.llama3_8b_config(base, 5, tmp_path, hw)
    assert [(t["seq_len"], t["fits"]) for t in tried] == [(4096, True)]
    assert cfg["train"]["method"] == "qlora" and cfg["strategy"] == {"gpu_memory_headroom": 0.9}
    p = gpu_check.predict(cfg, hw)
    assert p["feasible"] and p["seq_len"] == 4096
    # with liger-kernel installed (the gpu extra) its fused norms too: the DDP engine's tiles hold 5 hidden-sized
    # gradients per token (planner/constants.py CHECKPOINTED_SLICE_GRADIENTS)
    assert p["strategy"] in ("ddp-bf16-ac-actoff-embcpu-ce16-mlp4-mb1", "ddp-bf16-ac-actoff-embcpu-ce16-mlp4-liger-mb1")
    assert 6.5 * GiB < p["gpu_bytes"] <= 0.9 * 8 * GiB
    arch = json.loads((tmp_path / "base-llama3-8b" / "config.json").read_text())
    assert (arch["hidden_size"], arch["num_hidden_layers"], arch["num_key_value_heads"], arch["vocab_size"]) == (
        4096, 32, 8, 128256)
    small = resolve_hardware(profile="rtx3070", gpus=1, gpu_mem="3GiB")
    _, tried = qlora_zoo.llama3_8b_config(base, 5, tmp_path, small)
    assert [t["seq_len"] for t in tried][:2] == [4096, 3072] and not tried[1]["fits"] and len(tried) > 2
    assert tried[-1]["fits"] or tried[-1]["seq_len"] == qlora_zoo.SEQ_LENS_8B[-1]


@pytest.mark.slow
def test_a_qlora_entry_runs_from_its_written_base_through_the_capping_worker(tmp_path):
    """run_entry as the GPU check calls it, on CPU: the base's weights written (timed), launched through
    bench.gpu_worker under DDP with the chunked loss, metrics read, the run dir removed."""
    from orchestrate.hardware.resolve import resolve_hardware

    cfg = gpu_check.config_for("qlora-ddp-chunked-loss", 3, tmp_path)
    assert cfg["train"]["method"] == "qlora" and cfg["train"]["loss_chunks"] == 8
    cfg["model"]["name_or_path"] = str(random_base.write_config(TINY, tmp_path / "tiny-base"))
    cfg["train"].update(seq_len=64, global_batch_size=2, eval_every=0)
    row = gpu_check.run_entry("qlora-ddp-chunked-loss", cfg, resolve_hardware(gpus=1), tmp_path, 240, keep=False)
    assert row["status"] == "ok", row["run"]["log_tail"]
    assert row["base_write_s"] >= 0 and (tmp_path / "tiny-base" / random_base.INDEX).is_file()
    m = row["measured"]
    assert m["steps"] == 3 and m["tokens_per_s"] > 0 and all(map(math.isfinite, m["loss_first_last"]))
    assert not (tmp_path / "qlora-ddp-chunked-loss").exists()  # deleted: merged models are GBs on a GPU
    assert os.path.isfile(row["run"]["log"])


def test_only_runs_the_named_entries_and_refuses_unknown_ones(tmp_path):
    import argparse

    from orchestrate.hardware.resolve import resolve_hardware

    hw = resolve_hardware(profile="rtx3070", gpus=1, gpu_mem="8GiB")
    args = argparse.Namespace(only=["qlora-ddp-chunked-loss"], qlora_8b=False, steps=4)
    configs, search = gpu_check.entries(args, hw, tmp_path)
    assert list(configs) == ["qlora-ddp-chunked-loss"] and search == []
    args = argparse.Namespace(only=None, qlora_8b=True, steps=4)  # the zoo, then the 8B entry
    configs, search = gpu_check.entries(args, hw, tmp_path)
    assert list(configs) == [*gpu_check.ZOO, qlora_zoo.LLAMA3_8B] and search[0]["seq_len"] == 4096
    with pytest.raises(SystemExit, match="unknown zoo entries"):
        gpu_check.entries(argparse.Namespace(only=["qlora-70b"], qlora_8b=False, steps=4), hw, tmp_path)


def test_a_run_that_fails_after_its_last_step_keeps_its_measurements(tmp_path, monkeypatch):
    """An 8B run killed while writing its merged model still has every step's peaks (metrics.jsonl)."""
    def fake_run_plan(config, hw, run_dir, timeout_s):
        run_dir.mkdir(parents=True)
        steps = config["train"]["max_steps"] if "done" in run_dir.name else 1
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(
            {"step": i, "loss": 1.0, "tokens_per_s": 5.0, "gpu_max_allocated_bytes": 7, "gpu_max_reserved_bytes": 8})
            + "\n" for i in range(steps)))
        return {"rc": None, "seconds": timeout_s, "log": "", "log_tail": ""}

    monkeypatch.setattr(gpu_check, "run_plan", fake_run_plan)
    cfg = {"model": {}, "train": {"max_steps": 3}}
    row = gpu_check.run_entry("done", cfg, None, tmp_path, 10, keep=True)
    assert row["status"] == "trained, then failed (rc None)" and row["measured"]["gpu_max_reserved_bytes"] == 8
    assert gpu_check.run_entry("cut", cfg, None, tmp_path, 10, keep=True)["status"] == "failed (rc None)"
