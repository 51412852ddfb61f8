"""This process's `Rank` (orchestrate/backends/rank.py) from torchrun's variables (or SLURM's under
`srun`), and the process group the plan's backend asks for.
"""

from __future__ import annotations

import os

import torch

from orchestrate.backends.rank import Rank
from orchestrate.backends.sequence_parallel import start_sequence_parallel
from orchestrate.errors import Problem, UserError
from orchestrate.planner.plan import RunPlan
from orchestrate.ports import free_port


def environment_ranks() -> tuple[int, int, int, int]:
    """(rank, local rank, world size, local world size) from the environment."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        # srun starts one task per rank and sets only SLURM_*; torch's env:// init reads RANK etc.
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise UserError("srun started this worker without a rendezvous address", [Problem(
                "MASTER_ADDR / MASTER_PORT", "not set in the environment",
                "in the batch script: export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" "
                "| head -n1) MASTER_PORT=29500")])
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    if "RANK" not in env:  # a single process started by hand: a world of one
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in env:
            env["MASTER_PORT"] = str(free_port())
    return (int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))


def start_rank(plan: RunPlan, process_group: str) -> Rank:
    """This process's Rank, with the default process group initialised with `process_group` (what the
    plan's training backend asks for: `Backend.process_group`)."""
    import torch.distributed as dist

    rank, local_rank, world_size, local_world_size = environment_ranks()
    if world_size != plan.world_size:
        raise UserError("the worker count does not match the plan", [Problem(
            "world size", f"{world_size} processes were started for a plan made for {plan.world_size}",
            f"start {plan.world_size} processes ({plan.hardware.nodes} node(s) x "
            f"{plan.hardware.ranks_per_node}), or re-plan for this many")])
    if plan.hardware.has_gpu:
        if not torch.cuda.is_available():
            raise UserError("this plan needs GPUs but CUDA is not available here", [Problem(
                "hardware", f"the plan is for {plan.hardware.gpus_per_node} x {plan.hardware.gpu.name}",
                "run it on the machine it was planned for, or re-plan for CPU processes")])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(process_group)
    return Rank(rank, local_rank, world_size, rank // max(1, local_world_size), device,
                start_sequence_parallel(plan, rank, world_size))
