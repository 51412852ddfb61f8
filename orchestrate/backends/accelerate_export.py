"""Export a plan as an `accelerate launch --config_file` YAML, for users who train with their own
Accelerate script but want orchestrate's choice of strategy.

The file carries the same decisions as the backend's own rendered config: DeepSpeed points at the
rendered deepspeed.json (same directory), FSDP maps `fsdp_settings` onto Accelerate's FSDP2 keys,
DDP becomes plain multi-process data parallel. Pure: no I/O, no devices.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from orchestrate.backends.deepspeed_render import CONFIG_FILE as DEEPSPEED_CONFIG_FILE
from orchestrate.backends.fsdp import fsdp_settings

if TYPE_CHECKING:
    from orchestrate.planner.plan import RunPlan

_MIXED = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


def _fsdp_config(plan: RunPlan) -> dict[str, Any]:
    st = fsdp_settings(plan)
    config = {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": st["fully_shard"]["reshard_after_forward"],
        "fsdp_offload_params": st["cpu_offload"],
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        # Accelerate reads the block classes as one comma-separated string.
        "fsdp_transformer_layer_cls_to_wrap": ",".join(st["fully_shard"]["block_classes"] or []) or None,
        # Rank 0 loads the weights, the others start on meta and receive their shards (what
        # orchestrate's own FSDP setup does); accelerate's launcher requires sync_module_states with it.
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_sync_module_states": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_activation_checkpointing": st["activation_checkpointing"],
    }
    return {k: v for k, v in config.items() if v is not None}


def render_accelerate_config(plan: RunPlan, backend_files_dir: str | Path) -> str:
    """The accelerate config YAML for `plan`; `backend_files_dir` is where the backend's rendered
    files (deepspeed.json) are written, so the YAML can point at them."""
    cand = plan.chosen
    if cand is None:
        raise ValueError("the plan has no chosen strategy to export")
    s, hw = cand.strategy, plan.hardware
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "use_cpu": not hw.has_gpu,
        "num_machines": hw.nodes,
        "num_processes": plan.world_size,
        "machine_rank": 0,
        "rdzv_backend": "static",
        "same_network": True,
        "gpu_ids": "all",
    }
    if s.backend != "deepspeed":
        # DeepSpeed's precision lives in deepspeed.json: Accelerate refuses a config that also sets
        # mixed_precision next to deepspeed_config_file (DeepSpeedPlugin._deepspeed_config_checks).
        config["mixed_precision"] = _MIXED[s.precision]
    if s.backend == "deepspeed":
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {
            "deepspeed_config_file": str(Path(backend_files_dir) / DEEPSPEED_CONFIG_FILE),
            # ZeRO-3 builds the model already partitioned (deepspeed.zero.Init), like orchestrate does.
            "zero3_init_flag": s.zero_stage == 3,
        }
    elif s.backend == "fsdp":
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = _fsdp_config(plan)
        if s.hybrid_shard:  # FSDP2 hybrid shard: Accelerate's 2-D (replicate x shard) device mesh
            config["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": hw.nodes,
                "parallelism_config_dp_shard_size": hw.ranks_per_node,
            }
    elif plan.world_size == 1:
        config["distributed_type"] = "NO"
    else:
        # MULTI_GPU selects accelerate's torchrun launcher; with use_cpu the processes run gloo on
        # the CPU and Accelerate reports MULTI_CPU (its MULTI_CPU type itself launches one process
        # unless an MPI hostfile is given).
        config["distributed_type"] = "MULTI_GPU"
    header = (f"# accelerate config for orchestrate plan {s.name} ({plan.world_size} processes on "
              f"{hw.nodes} machine(s)).\n")
    if not hw.has_gpu:
        # accelerate's torchrun launcher does not pass use_cpu on to the processes (only its
        # single-process launcher sets ACCELERATE_USE_CPU); without it they each see one process.
        header += "# CPU-only: run as `ACCELERATE_USE_CPU=true accelerate launch --config_file <this file> ...`.\n"
    if hw.nodes > 1:
        header += ("# On each machine set machine_rank (0 on the main one) and main_process_ip/main_process_port\n"
                   "# to the main machine's address, or pass --machine_rank/--main_process_ip to accelerate launch.\n")
    return header + yaml.safe_dump(config, sort_keys=False)
