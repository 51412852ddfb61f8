"""Build a RunPlan for a pinned strategy without running the planner, for backend and worker tests.

The memory and speed estimates of such a plan are empty on purpose: these tests exercise rendering
and training, not prediction.
"""

from __future__ import annotations

from pathlib import Path

from orchestrate.config.load import config_from_dict
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.planner.estimate import MemoryEstimate, SpeedEstimate
from orchestrate.planner.plan import Candidate, RunPlan
from orchestrate.planner.strategy import Strategy, data_parallel_size

TINY_GPT2 = {
    "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
    "vocab_size": 257, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
}


def cpu_hardware(ranks: int) -> HardwareProfile:
    return HardwareProfile(name="cpu-test", gpus_per_node=0, cpu_processes=ranks,
                           cpu_memory_bytes=16 * 2**30, cpu_cores=2)


def make_plan(strategy: Strategy, ranks: int = 2, config: dict | None = None,
              source_dir: Path | None = None) -> RunPlan:
    from orchestrate.model.meta import load_model_config, shape_from_config

    data = {
        "model": {"architecture": dict(TINY_GPT2)},
        "train": {"seq_len": 32, "global_batch_size": 8, "max_steps": 6, "seed": 0,
                  "precision": strategy.precision, "micro_batch_size": strategy.micro_batch_size},
    }
    for section, values in (config or {}).items():
        data.setdefault(section, {}).update(values)
    cfg = config_from_dict(data, source_dir)
    shape = shape_from_config(load_model_config(cfg), task=cfg.model.task)
    readers = data_parallel_size(strategy, ranks)  # a sequence-parallel group reads one sample stream
    accumulation = max(1, cfg.train.global_batch_size // (strategy.micro_batch_size * readers))
    cand = Candidate(strategy, MemoryEstimate({}, {}), SpeedEstimate(0.0, 0.0), accumulation, fits=True)
    return RunPlan(config=cfg, hardware=cpu_hardware(ranks), shape=shape, candidates=[cand], chosen=cand)
