"""bench/gpu_check.py: its --dry-run on CPU (imports, plans the zoo, writes the JSON) and its pure parts.

The real check needs a CUDA GPU; this keeps the script importable and its zoo plannable in CI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check
from bench.gpu_worker import cap_fraction

ROOT = Path(__file__).parents[3]
GiB = 2**30

# zoo entry -> what the planned strategy's name must contain (the pins were honoured)
EXPECTED = {
    "fsdp2-full-shard-cpu-offload": "fsdp-full-offload_opt_cpu-offload_param_cpu",
    "zero2-optimizer-offload": "deepspeed-z2-offload_opt_cpu",
    "zero3-parameter-offload": "deepspeed-z3-offload_opt_cpu-offload_param_cpu",
    "qlora-ddp-chunked-loss": "ddp-bf16",  # with the pinned 8 loss chunks (CHUNKED)
    "qlora-fsdp2-full-shard": "fsdp-full-bf16",
    "qlora-llama3-8b": "ddp-bf16-ac-actoff-embcpu-ce16-mlp4",  # --qlora-8b: 8B on 8 GiB at 4096
}
CHUNKED = "-ce8-"
"""The QLoRA entry's pinned loss chunks; its micro-batch and recompute are the planner's (on the H200 one
micro-batch of 8 with recompute: each micro-batch costs each 4-bit linear a fixed time, methods/lora/speed.py)."""


@pytest.mark.slow  # seconds of replays or real tokenizer runs: kept out of the fast tier
def test_dry_run_plans_every_zoo_entry_and_writes_the_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--json", str(out),
                           "--keep", str(tmp_path / "work"), "--qlora-8b"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["gpu_tests"]["summary"] == "not run (dry run)"
    assert isinstance(result["missing_distributions"], list)
    assert set(result["plans"]) == set(EXPECTED)
    capacity = result["hardware"]["gpu"]["memory_bytes"]
    assert capacity == 8 * GiB
    for name, row in result["plans"].items():
        p = row["prediction"]
        assert row["status"] == "planned" and p["feasible"], (name, p)
        assert p["strategy"].startswith(EXPECTED[name]), (name, p["strategy"])
        assert name != "qlora-ddp-chunked-loss" or CHUNKED in p["strategy"]
        # The pinned offload plan fits the 8 GiB card, yet the model states alone would not.
        assert 0 < p["gpu_allocator_bytes"] < p["gpu_bytes"] <= capacity
        assert p["tokens_per_s"] > 0 and "measured" not in row
    assert "fsdp2-full-shard-cpu-offload" in proc.stdout  # the table was printed
    assert result["plans"]["qlora-llama3-8b"]["prediction"]["seq_len"] == 4096
    assert result["qlora_8b_seq_search"]["gpu_memory_headroom"] == 0.9
    # The QLoRA bases were planned from their config.json; a dry run writes no weights.
    assert {p.name for p in (tmp_path / "work").glob("base-*")} == {"base-llama-0.9b", "base-llama3-8b"}
    assert not list((tmp_path / "work").rglob("*.safetensors"))


def test_cap_fraction_is_the_planned_card_on_the_real_one():
    assert cap_fraction(8 * GiB, 140 * GiB) == pytest.approx(8 / 140)
    assert cap_fraction(16 * GiB, 8 * GiB) == 1.0  # never above the whole card
    with pytest.raises(ValueError):
        cap_fraction(0, 8 * GiB)


def test_measured_skips_warm_up_steps_and_takes_peaks_over_steps(tmp_path):
    rows = [{"step": i, "loss": 5.0 - i, "tokens_per_s": tps, "gpu_max_allocated_bytes": alloc,
             "gpu_max_reserved_bytes": alloc + 10} for i, (tps, alloc) in
            enumerate([(10.0, 5), (20.0, 7), (100.0, 6), (110.0, 6), (90.0, 6)], start=1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = gpu_check.measured(tmp_path)
    assert m["steps"] == 5 and m["tokens_per_s"] == 100.0  # median of steps 3-5
    assert m["gpu_max_allocated_bytes"] == 7 and m["gpu_max_reserved_bytes"] == 17
    assert m["loss_first_last"] == [4.0, 0.0]
    assert gpu_check.measured(tmp_path / "none") == {}


def test_zoo_configs_pin_the_strategy_and_keep_runs_short(tmp_path):
    for name, pins in gpu_check.ZOO.items():
        cfg = gpu_check.config_for(name, 4, tmp_path)
        assert cfg["strategy"] == pins and cfg["train"]["max_steps"] == 4
        assert cfg["train"]["output_dir"] == str(tmp_path)
        if name.startswith("qlora-"):  # a Llama base read from its directory, as a user's QLoRA run
            assert cfg["train"]["method"] == "qlora" and set(cfg["model"]) == {"name_or_path"}
        else:
            assert cfg["model"] == gpu_check.BASE["model"] and "method" not in cfg["train"]
    assert "strategy" not in gpu_check.BASE and "method" not in gpu_check.BASE["train"]  # copies, never mutates


@pytest.mark.slow
def test_a_plan_runs_through_launch_with_the_capping_worker(tmp_path):
    """The real path minus CUDA: orchestrate.api.launch starts torchrun with `-m bench.gpu_worker` (no cap
    without a GPU), the unchanged worker trains, and measured() reads its metrics."""
    from orchestrate.config.load import load_config
    from orchestrate.hardware.resolve import resolve_hardware

    config = load_config(ROOT / "examples" / "tiny-gpt2.yaml",
                         ["train.max_steps=3", "train.eval_every=0", f"train.output_dir={tmp_path}"])
    run_dir = tmp_path / "run"
    run = gpu_check.run_plan(config.model_dump(mode="json"), resolve_hardware(gpus=1), run_dir, timeout_s=240)
    assert run["rc"] == 0, run["log_tail"]
    assert f"-m {gpu_check.WORKER_MODULE} " in (run_dir / "launch.sh").read_text()
    m = gpu_check.measured(run_dir)
    assert m["steps"] == 3 and m["tokens_per_s"] > 0


def test_the_h200_profile_plans_every_zoo_entry_within_the_cap(tmp_path):
    """bench/profiles/h200.yaml is what a run on an H200 plans with (its memory set to 8 GiB)."""
    import argparse

    args = argparse.Namespace(profile=None, gpu_mem="8GiB")
    hw = gpu_check.hardware(args, "NVIDIA H200")
    assert hw.gpu.name == "NVIDIA H200" and hw.gpu.memory_bytes == 8 * GiB and hw.gpu.peak_tflops_bf16 > 900
    assert gpu_check.hardware(args, None).gpu.name == "NVIDIA GeForce RTX 3070"  # a dry run without a GPU
    for name in gpu_check.ZOO:
        p = gpu_check.predict(gpu_check.config_for(name, 4, tmp_path), hw)
        assert p["feasible"] and p["gpu_bytes"] <= 8 * GiB, (name, p)
        assert p["strategy"].startswith(EXPECTED[name])
        assert name != "qlora-ddp-chunked-loss" or CHUNKED in p["strategy"]
