"""Accelerate config export: every variant loads with accelerate's own loader (fast), and
`accelerate launch --config_file` really starts 2 CPU processes for the DDP and FSDP variants (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orchestrate.backends.accelerate_export import render_accelerate_config
from orchestrate.hardware.profile import GPUSpec, HardwareProfile
from orchestrate.planner.strategy import Strategy
from orchestrate.ports import free_port
from tests.helpers.plans import make_plan

FSDP_FULL = Strategy("fsdp", 3, "none", "none", "bf16", True, 2)
FSDP_GRAD_OP = Strategy("fsdp", 2, "none", "none", "fp32", False, 2)
FSDP_HYBRID = Strategy("fsdp", 3, "none", "none", "bf16", False, 2, hybrid_shard=True)
DDP = Strategy("ddp", 0, "none", "none", "fp32", False, 2)
DS_Z2 = Strategy("deepspeed", 2, "none", "none", "bf16", False, 2)
DS_Z3 = Strategy("deepspeed", 3, "cpu", "cpu", "bf16", True, 2)


def gpu_hardware(nodes: int = 1, gpus: int = 2) -> HardwareProfile:
    return HardwareProfile(name="gpu-test", nodes=nodes, gpus_per_node=gpus, cpu_memory_bytes=64 * 2**30, gpu=GPUSpec(
        name="NVIDIA GeForce RTX 3070", memory_bytes=8 * 2**30, compute_capability=(8, 6), peak_tflops_fp16=40.6,
        peak_tflops_bf16=40.6, peak_tflops_fp32=20.3))


def load(text: str, tmp_path: Path):
    from accelerate.commands.config.config_args import load_config_from_file

    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    return load_config_from_file(str(path))


def test_ddp_on_cpu(tmp_path):
    cfg = load(render_accelerate_config(make_plan(DDP), tmp_path), tmp_path)
    assert cfg.distributed_type == "MULTI_GPU"  # accelerate's torchrun launcher; MULTI_CPU at run time
    assert (cfg.num_processes, cfg.num_machines, cfg.use_cpu, cfg.mixed_precision) == (2, 1, True, "no")
    assert cfg.fsdp_config == {} and cfg.deepspeed_config == {}


def test_single_process_ddp_is_not_distributed(tmp_path):
    cfg = load(render_accelerate_config(make_plan(DDP, ranks=1), tmp_path), tmp_path)
    assert cfg.distributed_type == "NO" and cfg.num_processes == 1


def test_fsdp_full_shard(tmp_path):
    text = render_accelerate_config(make_plan(FSDP_FULL), tmp_path)
    assert text.startswith("# accelerate config for orchestrate plan fsdp-full-bf16-ac-mb2")
    assert "ACCELERATE_USE_CPU=true" in text  # the CPU-only hint
    cfg = load(text, tmp_path)
    assert cfg.distributed_type == "FSDP" and cfg.mixed_precision == "bf16" and cfg.num_processes == 2
    assert cfg.fsdp_config == {
        "fsdp_version": 2, "fsdp_reshard_after_forward": True, "fsdp_offload_params": False,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": "GPT2Block",
        "fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_activation_checkpointing": True,
    }
    assert cfg.parallelism_config == {}


def test_fsdp_grad_op_on_gpus(tmp_path):
    plan = make_plan(FSDP_GRAD_OP)
    plan.hardware = gpu_hardware()
    text = render_accelerate_config(plan, tmp_path)
    assert "ACCELERATE_USE_CPU" not in text
    cfg = load(text, tmp_path)
    assert cfg.use_cpu is False and cfg.mixed_precision == "no"
    assert cfg.fsdp_config["fsdp_reshard_after_forward"] is False
    assert cfg.fsdp_config["fsdp_activation_checkpointing"] is False


def test_fsdp_hybrid_on_two_machines(tmp_path):
    plan = make_plan(FSDP_HYBRID, ranks=4, config={"model": {"architecture": {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 257, "max_position_embeddings": 64}}})
    plan.hardware = gpu_hardware(nodes=2, gpus=2)
    text = render_accelerate_config(plan, tmp_path)
    assert "machine_rank" in text.split("\n", 3)[2]  # the multi-machine hint
    cfg = load(text, tmp_path)
    assert (cfg.num_processes, cfg.num_machines) == (4, 2)
    assert cfg.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    assert cfg.parallelism_config == {"parallelism_config_dp_replicate_size": 2,
                                      "parallelism_config_dp_shard_size": 2}


@pytest.mark.parametrize("strategy", [DS_Z2, DS_Z3], ids=["z2", "z3-offload"])
def test_deepspeed_points_at_the_rendered_json(strategy, tmp_path):
    cfg = load(render_accelerate_config(make_plan(strategy), tmp_path / "files"), tmp_path)
    assert cfg.distributed_type == "DEEPSPEED"
    assert cfg.deepspeed_config == {"deepspeed_config_file": str(tmp_path / "files" / "deepspeed.json"),
                                    "zero3_init_flag": strategy.zero_stage == 3}
    # Precision comes from deepspeed.json: accelerate refuses mixed_precision next to a config file.
    assert cfg.mixed_precision is None


STATE_SCRIPT = """
import json, os
from accelerate import Accelerator
state = Accelerator().state
env = {k: os.environ.get(k) for k in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "FSDP_TRANSFORMER_CLS_TO_WRAP",
                                      "FSDP_RESHARD_AFTER_FORWARD", "FSDP_ACTIVATION_CHECKPOINTING",
                                      "ACCELERATE_MIXED_PRECISION")}
print("STATE " + json.dumps({"rank": state.process_index, "distributed_type": state.distributed_type.value,
                             "num_processes": state.num_processes, "env": env}), flush=True)
"""


def _launch(config_text: str, tmp_path: Path, cpu: bool = True) -> list[dict]:
    (tmp_path / "accelerate.yaml").write_text(config_text)
    (tmp_path / "state.py").write_text(STATE_SCRIPT)
    env = {**os.environ, **({"ACCELERATE_USE_CPU": "true"} if cpu else {})}  # as the YAML header says
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "accelerate.yaml"),
           "--main_process_port", str(free_port()), str(tmp_path / "state.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Both processes write to one pipe, so their lines can interleave: decode each object where it starts.
    decoder, out = json.JSONDecoder(), proc.stdout
    states = [decoder.raw_decode(out, i + len("STATE "))[0] for i in range(len(out)) if out.startswith("STATE ", i)]
    return sorted(states, key=lambda s: s["rank"])


@pytest.mark.slow
def test_accelerate_launch_runs_the_ddp_config_on_2_cpu_processes(tmp_path):
    states = _launch(render_accelerate_config(make_plan(DDP), tmp_path), tmp_path)
    assert [s["rank"] for s in states] == [0, 1]
    assert all(s["distributed_type"] == "MULTI_CPU" and s["num_processes"] == 2 for s in states)


@pytest.mark.slow
def test_accelerate_launch_runs_the_fsdp_config_on_2_cpu_processes(tmp_path):
    states = _launch(render_accelerate_config(make_plan(FSDP_FULL), tmp_path), tmp_path)
    assert [s["rank"] for s in states] == [0, 1]
    for s in states:
        # Accelerate enables its FSDP plugin only on accelerators; on CPU the processes form a gloo
        # MULTI_CPU group and carry the FSDP2 settings the launcher read from the file.
        expected = "FSDP" if torch.cuda.is_available() else "MULTI_CPU"
        assert s["distributed_type"] == expected and s["num_processes"] == 2
        assert s["env"] == {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                            "FSDP_TRANSFORMER_CLS_TO_WRAP": "GPT2Block", "FSDP_RESHARD_AFTER_FORWARD": "true",
                            "FSDP_ACTIVATION_CHECKPOINTING": "true", "ACCELERATE_MIXED_PRECISION": "bf16"}


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=(
    "accelerate forms a DeepSpeed process group only on accelerators: on CPU its processes report "
    "MULTI_CPU (with ACCELERATE_USE_CPU) or each a 1-process DEEPSPEED state, so a CPU run proves nothing; "
    "needs 2 CUDA GPUs"))
def test_accelerate_launch_runs_the_deepspeed_config_on_2_gpus(tmp_path):
    from orchestrate.backends.deepspeed_render import render

    plan = make_plan(DS_Z2)
    plan.hardware = gpu_hardware()
    for name, text in render(plan).items():
        (tmp_path / name).write_text(text)
    states = _launch(render_accelerate_config(plan, tmp_path), tmp_path, cpu=False)
    assert [s["rank"] for s in states] == [0, 1]
    assert all(s["distributed_type"] == "DEEPSPEED" and s["num_processes"] == 2 for s in states)
