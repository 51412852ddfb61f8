"""Checkpoint files are read with `torch.load(weights_only=True)`: tensors and plain containers only,
never code a file could smuggle in through pickle.

Our own files do so directly. DeepSpeed (torch_checkpoint_engine.py, zero_to_fp32.py,
universal_checkpoint.py, ds_to_universal.py) and DCP's planner (non-tensor entries such as an
optimizer's param_groups) call `torch.load(..., weights_only=False)`; `weights_only_loads()` forces
weights_only=True around such calls, allowing only the named classes those files hold.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def deepspeed_checkpoint_classes() -> list[Any]:
    """The non-container classes DeepSpeed pickles into ZeRO checkpoints (found with
    torch.serialization.get_unsafe_globals_in_checkpoint on stage 1-3 checkpoints, fp32 and fp16)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextmanager
def weights_only_loads(allowed: list[Any] | tuple[Any, ...] = ()) -> Iterator[None]:
    """Within the block every `torch.load` is weights_only; a file holding anything else fails with
    torch's UnpicklingError naming the class. Not thread-safe: use it where the process loads."""
    import torch

    original = torch.load

    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    torch.load = load
    try:
        with torch.serialization.safe_globals(list(allowed)):
            yield
    finally:
        torch.load = original
