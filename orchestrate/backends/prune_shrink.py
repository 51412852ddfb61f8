"""Make a saved structured-pruned model physically smaller (`prune.method: structured`).

Training zeroes whole MLP channels (row c of gate_proj and up_proj, column c of down_proj) but
keeps the shapes, which every sharding strategy needs; after the consolidated model is written,
rank 0 rewrites it without those channels and with the smaller `intermediate_size` in config.json,
so `from_pretrained` builds the smaller model. The channels dropped are the `drop` of smallest norm
per block: exactly the zeroed ones. A documented subset of what torch-pruning does (MLP channels of
Llama-family blocks only; docs/pruning.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from orchestrate.backends.hf_io import follow_umask

_MLP = re.compile(r"^(.*\.\d+\.mlp)\.(gate_proj|up_proj|down_proj)\.weight$")


def _kept(weights: dict[str, torch.Tensor], drop: int) -> torch.Tensor:
    score = (weights["gate_proj"].double() ** 2).sum(1) + (weights["up_proj"].double() ** 2).sum(1) \
        + (weights["down_proj"].double() ** 2).sum(0)
    return torch.argsort(score, stable=True)[drop:].sort().values


def shrink_saved_mlp(model_dir: Path, drop: int) -> int:
    """Remove `drop` channels from every block's MLP in `model_dir`; returns the new intermediate_size."""
    from safetensors.torch import load_file, save_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    tensors = {path: load_file(str(path)) for path in files}
    blocks: dict[str, dict[str, tuple[Path, str]]] = {}
    for path, state in tensors.items():
        for key in state:
            if m := _MLP.match(key):
                blocks.setdefault(m.group(1), {})[m.group(2)] = (path, key)
    width = None
    for parts in blocks.values():
        keep = _kept({kind: tensors[path][key] for kind, (path, key) in parts.items()}, drop)
        for kind, (path, key) in parts.items():
            dim = 1 if kind == "down_proj" else 0
            tensors[path][key] = tensors[path][key].index_select(dim, keep).contiguous()
        width = len(keep)
    for path, state in tensors.items():
        save_file(state, str(path), metadata={"format": "pt"})
    follow_umask(Path(model_dir))
    config_path = Path(model_dir) / "config.json"
    config = json.loads(config_path.read_text())
    config["intermediate_size"] = width
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return width
