"""Rank functions that load a model directory in different ways, for `run_on_ranks` (module-level,
so spawned ranks can import them); each returns the rank's peak RSS (VmHWM) after a barrier, so all
ranks hold their weights at the same moment, as they do on the way to their GPUs."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from orchestrate.backends import hf_io
from tests.helpers.dist import init_gloo
from tests.helpers.memory import peak_rss


def _done() -> int:
    import torch.distributed as dist

    dist.barrier()
    return peak_rss()


def sharded_meta_model(model_dir: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from orchestrate.backends import hf_io
    from orchestrate.loading.weights import meta_model

    _, world = init_gloo()
    model, hf_config, layout = meta_model(Path(model_dir))
    mesh = init_device_mesh("cpu", (world,))
    for _, block in hf_io.find_blocks(model, hf_io.model_block_class_names(model, hf_config.model_type)):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model, layout


def naive(model_dir: str) -> int:
    """Every rank: transformers' from_pretrained in fp32 (the previous DDP / ZeRO-1/2 path)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    init_gloo()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():  # touch every weight, as moving it to a GPU does
        sum(float(p.sum()) for p in model.parameters())
    return _done()


def rank0_broadcast(model_dir: str) -> int:
    """FSDP2 with rank 0 reading the full state dict and broadcasting it (the previous FSDP path)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict


    model, layout = sharded_meta_model(model_dir)
    rank = torch.distributed.get_rank()
    full = read_full_state_dict(Path(model_dir), layout) if rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return _done()


def sharded(model_dir: str) -> int:
    """FSDP2 with every rank reading its own rows (orchestrate.loading.weights.load_sharded)."""
    from orchestrate.loading.weights import load_sharded

    model, layout = sharded_meta_model(model_dir)
    load_sharded(model, Path(model_dir), layout)
    return _done()


def replicated(model_dir: str) -> int:
    """Every rank: meta -> to_empty -> tensor by tensor (orchestrate.loading.weights.load_replicated)."""
    from orchestrate.loading.weights import load_replicated

    init_gloo()
    load_replicated(Path(model_dir), torch.device("cpu"), torch.float32)
    return _done()


def read_full_state_dict(model_dir: Path, layout: hf_io.StateLayout) -> dict[str, torch.Tensor]:
    """Every tensor of the model in `model_dir`, on CPU, named and typed as `layout` expects, tied
    aliases filled in: the naive rank-0 read the loading benchmarks and tests compare against (the
    backends load tensor by tensor instead, orchestrate.loading.weights)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    unexpected, wrong_shape = [], []
    for path in hf_io._weight_files(Path(model_dir)):
        for key, tensor in load_file(str(path)).items():
            target = hf_io._match_key(key, layout)
            if target is None:
                if not any(re.search(p, key) for p in layout.ignore_unexpected):
                    unexpected.append(key)
                continue
            shape, dtype = layout.tensors[target]
            if tuple(tensor.shape) != shape:
                wrong_shape.append(f"{key}: file {tuple(tensor.shape)}, model {shape}")
                continue
            state[target] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    for group in layout.tie_groups:  # HF writes a tied weight once; every alias needs it for loading
        present = next((state[k] for k in group if k in state), None)
        if present is not None:
            state.update({k: present for k in group})
    missing = sorted(set(layout.tensors) - set(state))
    hf_io.check_weights_match(model_dir, missing, unexpected, wrong_shape)
    return state
