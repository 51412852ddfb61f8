"""A backend's engine in a test without the worker's stages: this process as a `Rank`, the engine
building the base method's model and training the task's plain objective unless the test gives one."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from orchestrate.backends.base import ModelBuilder
from orchestrate.backends.rank import Rank
from orchestrate.methods.registry import base_runtime
from orchestrate.worker.objective import CausalLMObjective


def cpu_rank(rank: int = 0, world: int = 1, local_rank: int | None = None) -> Rank:
    """A CPU rank of a one-node job."""
    return Rank(rank, rank if local_rank is None else local_rank, world, 0, torch.device("cpu"))


def gpu_rank(rank: int = 0, world: int = 1) -> Rank:
    return Rank(rank, rank, world, 0, torch.device("cuda", rank))


def builder(plan) -> ModelBuilder:
    """The plan's base method's model builder, as the worker hands it to `Backend.setup`."""
    return partial(base_runtime(plan.config).build_model, plan)


def setup_engine(backend, plan, rank: Rank, model_dir: str | Path, objective=None):
    return backend.setup(plan, rank, Path(model_dir), objective or CausalLMObjective(), builder(plan))
