"""Hugging Face model helpers shared by the torch backends: read an HF model directory into a full
state dict (rank 0 only, the one full copy), restore what the meta device cannot hold, write a
consolidated HF directory, and find / checkpoint the transformer blocks.

Everything keys off the *unwrapped* model built on the meta device
(`orchestrate.model.meta.build_meta_model`), so no weight is materialised before it is needed.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from orchestrate.errors import Problem, UserError
from orchestrate.model.block_classes import block_class_names

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def model_block_class_names(model: nn.Module, model_type: str) -> list[str]:
    """`block_class_names`, falling back to the built model's own `_no_split_modules`."""
    names = block_class_names(model_type) or sorted(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise UserError("unsupported model layout", [Problem(
            "model", f"the {type(model).__name__} model names no transformer-block class (_no_split_modules)",
            "use a decoder-only family transformers ships (gpt2, llama, mistral, qwen2, phi3, ...)")])
    return names


def find_blocks(model: nn.Module, class_names: list[str]) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every transformer block, in forward order."""
    wanted = set(class_names)
    blocks = [(n, m) for n, m in model.named_modules() if type(m).__name__ in wanted]
    if not blocks:
        raise UserError("unsupported model layout", [Problem(
            "model", f"no module of class {', '.join(class_names)} in {type(model).__name__}",
            "use a decoder-only family transformers ships (gpt2, llama, mistral, qwen2, phi3, ...)")])
    return blocks


def checkpoint_blocks(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """Wrap each block in torch's non-reentrant `checkpoint_wrapper`, in place; returns the wrappers.

    Why this and not HF's `gradient_checkpointing_enable`: the wrapper becomes the module that
    FSDP2's `fully_shard` (and DDP's hooks) see, so the all-gather hooks sit *outside* the
    recomputed region and the recompute runs after FSDP's pre-backward unshard (torchtitan's and
    accelerate's FSDP2 composition). HF's version checkpoints `nn.Module.__call__`, hooks included,
    and its mechanics changed across transformers releases. DCP's state-dict helpers and the
    wrapper's own state-dict hooks strip the `_checkpoint_wrapped_module.` prefix, so keys stay HF's.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    wrappers = []
    for name, block in find_blocks(model, class_names):
        parent_name, _, child = name.rpartition(".")
        wrapper = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        setattr(model.get_submodule(parent_name), child, wrapper)
        wrappers.append(wrapper)
    return wrappers


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers onto `device` after `fully_shard`: FSDP2 shards parameters only, and an offloaded or CPU-built
    model would otherwise keep its buffers where it was allocated."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def _recomputed_buffers(model: nn.Module, module: nn.Module, config: Any, names: set[str],
                        device: torch.device) -> nn.Module:
    """A module of `module`'s type whose buffers `names` hold transformers' values: built from the config
    where the constructor takes one (rotary modules), else a shell of `module` without parameters or
    children whose buffers the model's own `_init_weights` fills (transformers 5 sets Gemma's
    `embed_scale` there, modeling_gemma.py GemmaPreTrainedModel._init_weights; the embedding table
    itself is left alone, so no vocabulary-sized copy is made)."""
    try:
        with torch.device(device):
            return type(module)(config=config)
    except TypeError:
        init_weights = getattr(model, "_init_weights", None)
        if init_weights is None:
            raise
    shell = copy.copy(module)
    shell._parameters = {k: None if v is None else nn.Parameter(torch.empty_like(v, device="meta"), v.requires_grad)
                         for k, v in module._parameters.items()}
    shell._buffers = {k: torch.empty_like(v, device=device) if k in names else v for k, v in module._buffers.items()}
    shell._modules = {}
    init_weights(shell)
    return shell


def restore_non_persistent_buffers(model: nn.Module, device: torch.device) -> None:
    """Recompute buffers that are in no checkpoint (rotary `inv_freq`, ...) after `to_empty`.

    A model built on the meta device has them on meta, and `to_empty` leaves garbage; HF's
    `post_init` does not recompute them. Each owning module is rebuilt from its `config` on
    `device` (a few KB: only the rotary module, not the model) and its buffers copied over, so
    every rope variant transformers implements is computed by transformers' own code."""
    for module in model.modules():
        names = getattr(module, "_non_persistent_buffers_set", set())
        if not names:
            continue
        # BertEmbeddings (position_ids, token_type_ids) keeps no config of its own: the model's builds it.
        config = getattr(module, "config", None) or getattr(model, "config", None)
        if config is None:
            raise UserError("unsupported model", [Problem(
                "model", f"{type(module).__name__} holds non-checkpointed buffers ({', '.join(sorted(names))}) "
                         "that orchestrate cannot recompute after meta-device initialisation",
                "use a family transformers ships (gpt2, llama, mistral, qwen2, phi3, ...)")])
        fresh = _recomputed_buffers(model, module, config, names, device)
        for name in names:
            module._buffers[name] = fresh._buffers[name].to(device)
        # transformers 4.x keeps `original_inv_freq` as a plain attribute next to the buffer.
        if isinstance(getattr(fresh, "original_inv_freq", None), torch.Tensor) and "original_inv_freq" not in names:
            module.original_inv_freq = fresh.original_inv_freq.to(device)


@dataclass(frozen=True)
class StateLayout:
    """What a model's full state dict must hold, taken from the unwrapped (meta) model."""

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]
    """state-dict key -> (shape, dtype): parameters and persistent buffers, tied aliases included."""
    tie_groups: tuple[tuple[str, ...], ...]
    """Keys naming one shared Parameter (GPT-2 `transformer.wte.weight` / `lm_head.weight`); the
    first of each group is the one written to disk, as HF's save_pretrained does."""
    base_model_prefix: str
    """HF's `base_model_prefix` ("transformer", "model"): old checkpoints omit it."""
    ignore_unexpected: tuple[str, ...]
    """HF's `_keys_to_ignore_on_load_unexpected` patterns (old buffers such as GPT-2 `attn.bias`)."""
    generation_config: Any = None
    """The model's `GenerationConfig` when it can generate (None otherwise): what `save_pretrained`
    writes as generation_config.json (transformers modeling_utils.py, `can_generate()`)."""

    @classmethod
    def of(cls, model: nn.Module) -> StateLayout:
        names_by_param: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names_by_param.setdefault(id(p), []).append(name)
        return cls(
            tensors={k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items()},
            tie_groups=tuple(tuple(names) for names in names_by_param.values() if len(names) > 1),
            base_model_prefix=getattr(model, "base_model_prefix", "") or "",
            ignore_unexpected=tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()),
            generation_config=model.generation_config if _can_generate(model) else None,
        )

    @property
    def aliases(self) -> set[str]:
        return {name for group in self.tie_groups for name in group[1:]}


def _can_generate(model: nn.Module) -> bool:
    can_generate = getattr(model, "can_generate", None)
    return bool(can_generate and can_generate() and getattr(model, "generation_config", None) is not None)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    if (model_dir / SAFETENSORS_FILE).is_file():
        return [model_dir / SAFETENSORS_FILE]
    raise UserError("model directory has no weights", [Problem(
        str(model_dir), f"neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX} found",
        "save the model with `save_pretrained(dir, safe_serialization=True)` (PyTorch .bin files are not read)")])


def _match_key(key: str, layout: StateLayout) -> str | None:
    if key in layout.tensors:
        return key
    prefix = layout.base_model_prefix + "." if layout.base_model_prefix else ""
    if prefix and prefix + key in layout.tensors:  # checkpoint of the bare base model (old GPT-2 files)
        return prefix + key
    if prefix and key.startswith(prefix) and key[len(prefix):] in layout.tensors:
        return key[len(prefix):]
    return None


def check_weights_match(model_dir: Path, missing: list[str], unexpected: list[str], wrong_shape: list[str]) -> None:
    """One UserError naming up to five keys of each kind of mismatch between files and model; none if all match."""
    problems = []
    for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", wrong_shape)):
        if keys:
            more = f" (and {len(keys) - 5} more)" if len(keys) > 5 else ""
            problems.append(Problem(str(model_dir), f"{label}: {', '.join(keys[:5])}{more}"))
    if problems:
        raise UserError("model weights do not match the model config", problems,
                        "the safetensors files must come from the model config.json describes")


def current_umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask


def follow_umask(out_dir: Path) -> None:
    """Give the model files the user's umask: safetensors' save_file (safetensors 0.4+, also under
    transformers' save_pretrained) writes through a private temporary file and renames it, so
    model.safetensors ends up mode 0600 whatever the umask."""
    mode = 0o666 & ~current_umask()
    for path in Path(out_dir).glob("*.safetensors"):
        path.chmod(mode)


def host_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` copied to the host a tensor at a time, a tensor under several names (tied weights)
    copied once and kept shared. For `save_pretrained`: safetensors allows no two tensors on one
    storage, so transformers clones every tensor that shares one, where it lies (5.25
    `save_pretrained`); DeepSpeed ZeRO-1/2's 16-bit parameters are all views of one flat buffer, so
    on a GPU that was a second copy of the weights in device memory after the last step
    (docs/measurements.md#backendshf_iopy)."""
    copies: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if key not in copies:
            copies[key] = tensor.detach().to("cpu", copy=True)  # a storage each, on a CPU run too
        out[name] = copies[key]
    return out


def save_hf_dir(state: dict[str, torch.Tensor], hf_config, out_dir: Path, layout: StateLayout) -> None:
    """Write `state` (a full CPU state dict) as an HF model directory: model.safetensors + config.json
    (+ generation_config.json for a model that generates, as `save_pretrained` does), tied aliases
    dropped (from_pretrained re-ties them)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    aliases = layout.aliases
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items() if k not in aliases}
    save_file(tensors, str(out_dir / SAFETENSORS_FILE), metadata={"format": "pt"})
    follow_umask(out_dir)
    hf_config.save_pretrained(out_dir)
    if layout.generation_config is not None:
        layout.generation_config.save_pretrained(out_dir)


def save_state_dir(state: dict[str, torch.Tensor], config, out_dir: Path) -> None:
    """Write `state` (a full state dict) as out_dir/model.safetensors, a tensor shared under several
    names once (under its first: safetensors refuses shared storage), and `config.save_pretrained`'s
    config.json: for a model without a `StateLayout` to name its ties (your own module on DeepSpeed)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seen: dict[int, str] = {}
    tensors = {}
    for key, t in state.items():
        if t.data_ptr() in seen and t.numel():
            continue
        seen[t.data_ptr()] = key
        tensors[key] = t.detach().to("cpu").contiguous()
    save_file(tensors, str(out_dir / SAFETENSORS_FILE), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
