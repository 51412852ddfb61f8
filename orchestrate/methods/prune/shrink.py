"""Make a saved structured-pruned model physically smaller (`prune.method: structured`).

Training zeroes whole MLP channels (row c of gate_proj and up_proj, column c of down_proj) and, with
`prune.heads`, whole query heads (rows of q_proj and its bias, columns of o_proj) but keeps the
shapes, which every sharding strategy needs; after the consolidated model is written, rank 0
rewrites it without them and with the smaller `intermediate_size` / `num_attention_heads` (and an
explicit `head_dim`, which transformers would otherwise derive as hidden_size / heads) in
config.json, so `from_pretrained` builds the smaller model. What is dropped is the lowest-norm
channels per block and heads per key/value group: exactly the zeroed ones. A documented subset of
what torch-pruning does (Llama-family blocks only; docs/pruning.md).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from orchestrate.backends.hf_io import follow_umask

_PART = re.compile(r"^(.*\.\d+)\.(mlp|self_attn)\.(gate_proj|up_proj|down_proj|q_proj|o_proj)\.(weight|bias)$")


@dataclass(frozen=True)
class Cut:
    channels: int
    """MLP channels to drop per block."""
    heads: int
    """Query heads to drop per key/value group (0: keep the attention)."""
    kv_heads: int
    head_dim: int


def _norms(parts: dict[str, torch.Tensor], rows: tuple[str, ...], col: str) -> torch.Tensor:
    return sum((parts[n].double() ** 2).sum(1) for n in rows) + (parts[col].double() ** 2).sum(0)


def _kept_channels(parts: dict[str, torch.Tensor], cut: Cut) -> torch.Tensor:
    score = _norms(parts, ("gate_proj.weight", "up_proj.weight"), "down_proj.weight")
    return torch.argsort(score, stable=True)[cut.channels:].sort().values


def _kept_heads(parts: dict[str, torch.Tensor], cut: Cut) -> torch.Tensor:
    """The element indices (rows of q_proj, columns of o_proj) of the heads kept in every group."""
    d = cut.head_dim
    q, o = parts["q_proj.weight"], parts["o_proj.weight"]
    score = (q.double() ** 2).view(-1, d * q.shape[1]).sum(1) + (o.double() ** 2).view(o.shape[0], -1, d).sum((0, 2))
    groups = score.view(cut.kv_heads, -1)
    heads = torch.argsort(groups, dim=1, stable=True)[:, cut.heads:].sort(dim=1).values
    heads = (heads + torch.arange(cut.kv_heads).unsqueeze(1) * groups.shape[1]).flatten()
    return (heads.unsqueeze(1) * d + torch.arange(d)).flatten()


_DIM = {"gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1, "q_proj.weight": 0, "q_proj.bias": 0,
        "o_proj.weight": 1}


def shrink_saved_model(model_dir: Path, cut: Cut) -> dict[str, int]:
    """Remove the zeroed channels (and heads) from every block in `model_dir`; returns the config.json
    fields it changed."""
    from safetensors.torch import load_file, save_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    tensors = {path: load_file(str(path)) for path in files}
    blocks: dict[str, dict[str, tuple[Path, str]]] = {}
    for path, state in tensors.items():
        for key in state:
            m = _PART.match(key)
            name = f"{m.group(3)}.{m.group(4)}" if m else ""
            if name in _DIM and (m.group(2) == "mlp" or cut.heads):  # o_proj's bias is per output: kept
                blocks.setdefault(m.group(1), {})[name] = (path, key)
    changed: dict[str, int] = {}
    for parts in blocks.values():
        values = {name: tensors[path][key] for name, (path, key) in parts.items()}
        keep = {"mlp": _kept_channels(values, cut)}
        changed["intermediate_size"] = len(keep["mlp"])
        if cut.heads:
            keep["attn"] = _kept_heads(values, cut)
            changed["num_attention_heads"], changed["head_dim"] = len(keep["attn"]) // cut.head_dim, cut.head_dim
        for name, (path, key) in parts.items():
            index = keep["mlp" if name.split("_")[0] in ("gate", "up", "down") else "attn"]
            tensors[path][key] = tensors[path][key].index_select(_DIM[name], index).contiguous()
    for path, state in tensors.items():
        save_file(state, str(path), metadata={"format": "pt"})
    follow_umask(Path(model_dir))
    config_path = Path(model_dir) / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **changed}, indent=2, sort_keys=True)
                           + "\n")
    return changed
