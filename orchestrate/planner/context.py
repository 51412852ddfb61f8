"""`orchestrate plan`'s check of train.seq_len against the model's position table (pure).

The launcher reports the same problem together with the data section's (`check_data_config`), so
this lives outside `make_plan`, which the launcher calls first and which would hide those.
"""

from __future__ import annotations

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem, UserError
from orchestrate.model.shape import ModelShape


def check_seq_len(config: RunConfig, shape: ModelShape) -> None:
    """A seq_len past max_position_embeddings: learned positions (GPT-2) index out of range, RoPE
    models run past the lengths they were trained for."""
    limit, seq_len = shape.max_position_embeddings, config.train.seq_len
    if limit and seq_len > limit:
        raise UserError("train.seq_len does not fit the model", [Problem(
            "train.seq_len", f"{seq_len} is longer than the model's max_position_embeddings {limit}",
            f"use train.seq_len <= {limit}")])
