"""The weights a rollout samples with, gathered once per rollout phase (docs/grpo.md, "Multi-rank").

Sampling runs one forward per decoded token. Under parameter sharding (FSDP2's `fully_shard` with
reshard_after_forward, DeepSpeed ZeRO-3) each of those forwards would all-gather every block and free
it again: max_completion_length gathers of the whole model per micro-batch, and ranks whose
completions end at different lengths would wait on collectives the others never call. `gathered`
holds the whole model, in the compute dtype, for the rollout phase instead, and no collective runs
inside it:

- FSDP2: every `FSDPModule` set not to reshard after forward (`set_reshard_after_forward(False)`, the
  use torch's docstring names: "set an FSDP module's value to False for running evals and set back to
  True for training") and unsharded (a one-token forward through the root, which FSDP2 needs first
  where the root is a peft model that HF generate never calls, then `unshard()`: one all-gather per
  module in all); after, each resharded and given back its setting (the root keeps False: FSDP2 never
  reshards the root after forward).
- DeepSpeed ZeRO-3: `deepspeed.zero.GatheredParameters` over every parameter, with the engine's
  ZeRO-3 module hooks removed inside it and registered again after (the parameter coordinator's trace
  invalidated), as TRL's `unwrap_model_for_generation` does (huggingface/trl, trl/models/utils.py:
  `_unwrap_model_for_generation`, `remove_hooks`, `add_hooks`; DeepSpeed >= 0.16.4's
  `_register_deepspeed_module`). With the parameters offloaded (offload_param: cpu) the same: each
  partition, in host memory, is gathered into a tensor on the device (partition_parameters.py
  `Init._all_gather`) and freed again on exit, the partition untouched (no update inside).
- DDP, ZeRO-0/1/2, one rank: the weights are whole on every rank already.

What the gathered weights take is in the plan (memory.py `gathered_weight_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from orchestrate.methods.preference.reference import without_dropout


def _zero3(model: torch.nn.Module) -> bool:
    """A DeepSpeed engine partitioning its parameters (ZeRO-3)."""
    partitioned = getattr(model, "zero_optimization_partition_weights", None)
    return callable(partitioned) and bool(partitioned())


def _zero3_offload(engine: torch.nn.Module):
    """The engine's ZeRO-3 parameter offload object, which owns the module hooks."""
    optimizer = engine.optimizer
    return getattr(optimizer, "parameter_offload", optimizer)


def _remove_zero3_hooks(engine: torch.nn.Module) -> None:
    offload = _zero3_offload(engine)
    for module in offload.module.modules():
        external = [param for _, param in module.ds_external_parameters()]  # (name, parameter) pairs
        for param in [*module.parameters(recurse=False), *external]:
            param.ds_active_sub_modules.clear()
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []


def _add_zero3_hooks(engine: torch.nn.Module) -> None:
    offload = _zero3_offload(engine)
    coordinator = getattr(offload, "param_coordinator", None)
    if coordinator is not None and not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()  # the generation's forwards are not the training step's trace
    offload._register_deepspeed_module(offload.module)


@contextmanager
def _fsdp2_unsharded(model: torch.nn.Module, reshard_after_forward: bool) -> Iterator[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    model.set_reshard_after_forward(False)
    try:
        # HF generate runs the causal LM's forward, not the root's where the root is a peft model; FSDP2
        # must see the root's forward first (its lazy init makes every other unit a non-root): one token
        # through the root, under no_grad and without dropout (no draw from the sampling's generator),
        # gathering every unit as it goes.
        with torch.no_grad(), without_dropout(model):
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=next(model.parameters()).device))
        for unit in units:
            unit.unshard()
        yield model
    finally:
        for unit in units:
            unit.reshard()
            if unit is not model:
                unit.set_reshard_after_forward(reshard_after_forward, recurse=False)


@contextmanager
def gathered(model: torch.nn.Module, reshard_after_forward: bool = True) -> Iterator[torch.nn.Module]:
    """The module to sample with (DDP's and DeepSpeed's inner module, the FSDP2 root itself), its
    weights whole for the block (module docstring); `reshard_after_forward`: the FSDP2 blocks' setting
    to give back (the plan's, backends/fsdp.py `fsdp_settings`)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        with _fsdp2_unsharded(model, reshard_after_forward) as inner:
            yield inner
    elif _zero3(model):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            _remove_zero3_hooks(model)
            try:
                yield model.module
            finally:
                _add_zero3_hooks(model)
    else:
        yield getattr(model, "module", model)
