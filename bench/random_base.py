"""A randomly initialised Hugging Face model directory in bf16, written tensor by tensor (bench/gpu_check.py).

The QLoRA entries of the GPU check read their frozen base from `model.name_or_path`, as a user's run
does, so the DDP backend quantizes it tensor by tensor as it loads (orchestrate/methods/lora/quantized_loading.py).
Without a base the worker would build the whole model in fp32 on the CPU and save it
(orchestrate/loading/init_weights.py): for the Llama-3-8B shape 32 GB of RAM and 32 GB of safetensors
before the first step. Here the model exists only on the meta device (shapes, no memory) and each
tensor is drawn on `device` (the GPU when there is one: drawing 8B values on the CPU is the slow part),
cast to bf16 and written shard by shard: host RAM holds one shard (`SHARD_BYTES`), the disk 2 B/param
(16 GB for 8B). Values follow transformers' `_init_weights` for these families: linear and embedding
weights N(0, initializer_range), biases 0, norm weights 1.

`write_config` writes config.json only (what planning reads: `--dry-run` writes no weights);
`write_weights` adds the shards and, last, model.safetensors.index.json, so a directory with an index
is complete and is reused (a rerun with `--keep`).
"""

from __future__ import annotations

import json
from pathlib import Path

SHARD_BYTES = 2 * 2**30
INDEX = "model.safetensors.index.json"


def write_config(architecture: dict, out_dir: Path) -> Path:
    from transformers import AutoConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(**architecture).save_pretrained(out_dir)
    return out_dir


def _shards(shapes: dict[str, tuple[int, ...]], element_bytes: int) -> list[list[str]]:
    """Keys grouped in state-dict order into shards of at most SHARD_BYTES (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, shape in shapes.items():
        n = element_bytes
        for d in shape:
            n *= d
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    return shards


def write_weights(out_dir: Path, seed: int = 0, device: str = "cpu") -> Path:
    """Random bf16 weights for the config.json in `out_dir`; returns the index (already there: kept)."""
    import torch
    from safetensors.torch import save_file
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    index = out_dir / INDEX
    if index.is_file():
        return index
    config = AutoConfig.from_pretrained(out_dir)
    if getattr(config, "tie_word_embeddings", False):
        # A tied alias would be written twice here; the zoo's bases are untied (Llama-3-8B is).
        raise ValueError("write_weights handles untied models only: set tie_word_embeddings: false")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    std = getattr(config, "initializer_range", 0.02)
    gen = torch.Generator(device).manual_seed(seed)
    shards = _shards(shapes, 2)
    weight_map, total = {}, 0
    for i, keys in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key in keys:
            owner = model.get_submodule(key.rpartition(".")[0])
            t = torch.empty(shapes[key], dtype=torch.float32, device=device)
            if key.endswith(".bias"):
                t.zero_()
            elif isinstance(owner, (nn.Linear, nn.Embedding)):
                t.normal_(0.0, std, generator=gen)
            else:  # RMSNorm / LayerNorm weight
                t.fill_(1.0)
            tensors[key] = t.to(torch.bfloat16).cpu()
            weight_map[key] = name
            total += tensors[key].numel() * 2
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        del tensors
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return index
