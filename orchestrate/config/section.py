"""What every model.yaml section shares: strict pydantic settings and the bounds of counts."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Auto = Literal["auto"]

MAX_COUNT = 2**31 - 1
"""Upper bound of counts (tokens, samples, steps): torch and numpy index with int32/int64, and a
value this large is a typo, not a plan."""


class Section(BaseModel):
    # Unknown keys are an error: a typo such as `seq_length` must not be silently ignored.
    # strict: no bool -> int (`seq_len: true` is not 1), no int/str -> bool (`trust_remote_code: "yes"`),
    # no str -> number; int -> float stays allowed (https://docs.pydantic.dev/latest/concepts/conversion_table/).
    # allow_inf_nan=False: `.inf` passes `gt=0` but is no learning rate.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True, strict=True,
                              allow_inf_nan=False)
