"""Your own dataset factory (`data.module`) as the custom method's part of the data path
(orchestrate/data/method_data.py `OwnData`): checked and described on the launcher (data.py), and
the worker's TrainData: the same sampler as the token data (distributed, shuffled per epoch,
world-size independent, resumable exactly; orchestrate.data.sampler) over the training part of the
split."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrate.config.schema import RunConfig
from orchestrate.data.method_data import OwnData
from orchestrate.data.pipeline import TrainData
from orchestrate.data.sampler import DistributedBlockSampler
from orchestrate.errors import Problem, UserError
from orchestrate.methods.custom.data import (
    WHERE,
    check_module_data_config,
    describe_module_data,
    load_dataset,
    split,
)

if TYPE_CHECKING:
    from orchestrate.planner.plan import RunPlan


def build_module_data(plan: RunPlan, rank: int, world_size: int) -> TrainData:
    config = plan.config
    train, validation = split(load_dataset(config), config.data.validation_ratio, config.train.seed)
    if len(train) < world_size:
        raise UserError("not enough training data", [Problem(
            WHERE, f"{len(train)} training samples for {world_size} ranks", "return more samples")])
    sampler = DistributedBlockSampler(len(train), rank, world_size, config.train.seed)
    return TrainData(None, train, validation, sampler)


def data_path(config: RunConfig) -> OwnData:
    return OwnData(check_module_data_config, describe_module_data, build_module_data)
