"""The frozen input embedding kept in host memory (`Strategy.embedding_offload`, planner/knobs.py; DDP).

The loaders allocate and fill the table on the CPU (`host_names`, `allocate`), so it never touches the
GPU; the rest of the model moves to the device around it (`to_device_keeping_embedding`); two hooks on
`get_input_embeddings()` route each lookup (`route_lookups`): the token ids go to the table, the rows
(b x s x h) come back to the device the blocks run on. The table is frozen (LoRA / QLoRA), so autograd
never reaches it: no gradient, no backward transfer.
"""

from __future__ import annotations

import torch
from torch import nn

HOST = torch.device("cpu")


def host_names(model: nn.Module, on: bool) -> set[str]:
    """State-dict names of the input embedding's tensors (what stays on the CPU); empty when `on` is False."""
    if not on:
        return set()
    table = {id(t) for t in (*model.get_input_embeddings().parameters(), *model.get_input_embeddings().buffers())}
    return {name for name, t in (*model.named_parameters(), *model.named_buffers()) if id(t) in table}


def allocate(model: nn.Module, device: torch.device, host_embedding: bool) -> None:
    """`model.to_empty(device=device)`, the input embedding's storage on the CPU when `host_embedding`."""
    if not host_embedding:
        model.to_empty(device=device)
        return
    host = set(model.get_input_embeddings().modules())
    for module in model.modules():  # each module's own tensors only: the embedding's never go to `device`
        module.to_empty(device=HOST if module in host else device, recurse=False)


def to_device_keeping_embedding(model: nn.Module, device: torch.device) -> None:
    """`model.to(device)` for everything but the input embedding, which stays where it is (the CPU).
    Detached for the move so that `Module.to` keeps its own handling of every other tensor (bitsandbytes
    quantizes a Params4bit on its first move to a device)."""
    embedding = model.get_input_embeddings()
    owner, attr = next((m, n) for m in model.modules() for n, child in m.named_children() if child is embedding)
    setattr(owner, attr, None)
    try:
        model.to(device)
    finally:
        setattr(owner, attr, embedding)


def route_lookups(model: nn.Module, device: torch.device) -> None:
    """Token ids to the table's device before the lookup, the looked-up rows to `device` after it."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if head is not None and head.weight is embedding.weight:  # the planner refuses it (knobs.py); guard hand-made plans
        raise RuntimeError("embedding_offload: the input embedding is tied to the LM head, which needs it on the GPU")
    table = embedding.weight.device

    def ids_to_table(_module: nn.Module, args: tuple) -> tuple:
        return tuple(a.to(table) if isinstance(a, torch.Tensor) else a for a in args)

    def rows_to_device(_module: nn.Module, _args: tuple, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(device)

    embedding.register_forward_pre_hook(ids_to_table)
    # prepend: before any other forward hook on the embedding (e.g. transformers' enable_input_require_grads),
    # so what those see, and what autograd records, is the rows on the device, not on the host.
    embedding.register_forward_hook(rows_to_device, prepend=True)
