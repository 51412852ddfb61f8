"""Your own nn.Module (`model.module`): import it, build it, and read its shape on the meta device.

`shape_of_module(module_or_factory, kwargs)` is the general entry point (also for a module a user's
own training loop hands over): it builds the module under `torch.device("meta")` (no memory, no
init) and counts what the planner needs: parameters (shared ones once), the largest layer
(DeepSpeed's largest_layer_params: parameters held directly by one module) and the repeated block
classes FSDP2 shards one by one. Activations have no formula for an arbitrary module; they are
measured by `orchestrate.methods.custom.activations`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.config.model import TRUST_SWITCH
from orchestrate.errors import Problem, UserError
from orchestrate.model.shape import ModelShape

if TYPE_CHECKING:
    import torch
    from torch import nn

    from orchestrate.config.schema import RunConfig

MODEL_TYPE = "custom"
MODULE_FILE = "config.json"
"""What RUN_DIR/model holds next to model.safetensors: the module path and kwargs that rebuild it."""


def is_custom(config: RunConfig) -> bool:
    return config.model.module is not None


@contextlib.contextmanager
def _on_path(directory: Path | None):
    """The YAML file's directory first on sys.path while importing: modules next to it import as-is."""
    if directory is None:
        yield
        return
    sys.path.insert(0, str(directory))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(directory))


def require_trust(config: RunConfig, where: str, what: str) -> None:
    """UserError unless the config opted in to running the code `what` names (nothing is imported first)."""
    if not config.model.trust_remote_code:
        raise UserError("the config names code to run, and running it is not allowed", [Problem(
            where, f"{what} would be imported and run here and in every worker; code from a config runs "
            f"only with {TRUST_SWITCH}: true",
            f"read that code first; if you trust it, set {TRUST_SWITCH}: true in the YAML "
            f"(or --set {TRUST_SWITCH}=true)")])


def import_object(spec: str, where: str, config: RunConfig) -> Any:
    """The object "package.module:Name" names, imported only when the config opted in
    (`model.trust_remote_code`); a UserError naming the path and the error otherwise. The YAML
    file's directory is first on sys.path while importing."""
    require_trust(config, where, repr(spec))
    source_dir = config.source_dir
    module_name, _, attr = spec.partition(":")
    fix = (f"check the spelling; the module must be importable (installed, on PYTHONPATH, or next to the "
           f"YAML file{f' in {source_dir}' if source_dir else ''})")
    try:
        with _on_path(source_dir):
            obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any error while importing user code is the user's to fix
        raise UserError(f"cannot import {spec}", [Problem(
            where, f"importing {module_name!r} failed: {type(exc).__name__}: {exc}", fix)]) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"cannot import {spec}", [Problem(
                where, f"module {module_name!r} has no attribute {attr!r}", fix)])
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserError(f"cannot import {spec}", [Problem(
            where, f"{spec} is a {type(obj).__name__}, not a class or factory", "name an nn.Module class or a function")])
    return obj


def instantiate(factory: Callable[..., Any], kwargs: dict[str, Any], where: str) -> nn.Module:
    """`factory(**kwargs)`, checked to be an nn.Module."""
    from torch import nn

    try:
        module = factory(**kwargs)
    except Exception as exc:  # noqa: BLE001 - user code
        raise UserError("cannot build model.module", [Problem(
            where, f"{getattr(factory, '__name__', factory)}(**kwargs) raised {type(exc).__name__}: {exc}",
            "fix model.kwargs (they are passed as keyword arguments) or the module's code")]) from None
    if not isinstance(module, nn.Module):
        raise UserError("model.module is not an nn.Module", [Problem(
            where, f"{getattr(factory, '__name__', factory)} returned a {type(module).__name__}",
            "name a torch.nn.Module subclass or a function returning one")])
    return module


def module_factory(config: RunConfig) -> Callable[..., Any]:
    return import_object(config.model.module, "model.module", config)


def build_module(config: RunConfig, device: torch.device | str = "cpu") -> nn.Module:
    """The configured module with its own initialisation, allocated on `device` (the caller seeds)."""
    import torch

    with torch.device(device):
        return instantiate(module_factory(config), config.model.kwargs, "model.module")


def _direct(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False))


def detect_block_classes(model: nn.Module) -> list[str]:
    """The most repeated submodule class that holds parameters (ties: more parameters per
    instance), as `_no_split_modules` names a transformer's blocks; [] when nothing repeats.
    Blocks are composite: leaf layers (Linear, Conv2d, norms) and torch's containers (ModuleList,
    Sequential, ModuleDict) are not candidates, or every MLP's Linear would be "the block"."""
    from torch import nn

    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    counts: Counter[str] = Counter()
    sizes: dict[str, int] = {}
    for name, m in model.named_modules():
        params = sum(p.numel() for p in m.parameters())
        composite = any(sum(p.numel() for p in c.parameters()) for c in m.children())
        if name and params and composite and not isinstance(m, containers):  # not the root
            cls = type(m).__name__
            counts[cls] += 1
            sizes[cls] = max(sizes.get(cls, 0), params)
    repeated = [c for c, n in counts.items() if n > 1]
    if not repeated:
        return []
    return [max(repeated, key=lambda c: (counts[c], sizes[c]))]


def _wrap_problems(model: nn.Module, wrap: list[str]) -> None:
    present = {type(m).__name__ for m in model.modules()}
    missing = [c for c in wrap if c not in present]
    if missing:
        raise UserError("strategy.wrap names classes the module does not have", [Problem(
            "strategy.wrap", f"{', '.join(missing)} not found; the module has {', '.join(sorted(present))}",
            "name submodule classes of model.module, or remove strategy.wrap to detect them")])


def shape_of_module(module_or_factory: nn.Module | Callable[..., Any], kwargs: dict[str, Any] | None = None,
                    wrap: list[str] | None = None) -> ModelShape:
    """The ModelShape of an nn.Module instance, or of `factory(**kwargs)` built on the meta device.
    Activations are not in it (`custom_activations.with_measured_activations` adds them)."""
    import torch
    from torch import nn

    if isinstance(module_or_factory, nn.Module):
        model = module_or_factory
    else:
        with torch.device("meta"):
            model = instantiate(module_or_factory, kwargs or {}, "model.module")
    if wrap:
        _wrap_problems(model, wrap)
    classes = list(wrap) if wrap else detect_block_classes(model)
    blocks = [m for m in model.modules() if type(m).__name__ in classes]
    unique = {id(p): p for p in model.parameters()}  # shared parameters once
    return ModelShape(
        model_type=MODEL_TYPE, parameters=sum(p.numel() for p in unique.values()),
        largest_layer_parameters=max((_direct(m) for m in model.modules()), default=0),
        embedding_parameters=sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding)
                                 for p in m.parameters()),
        lm_head_parameters=0, block_parameters=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
        # No transformer dimensions: the memory and speed terms that use them are replaced by the
        # measured activations (planner/memory.py); max_position_embeddings 0 means "no limit".
        hidden_size=0, num_layers=len(blocks), num_heads=0, num_kv_heads=0, head_dim=0, intermediate_size=0,
        vocab_size=0, max_position_embeddings=0, tied_embeddings=False, task=MODEL_TYPE,
        block_classes=tuple(classes))


class ModuleConfig:
    """Stands where a Hugging Face config goes when a model is saved: `save_pretrained(dir)` writes
    config.json with the module path and kwargs, which is all it takes to rebuild the module
    (docs/custom-module.md: load model.safetensors into it with load_state_dict)."""

    model_type = MODEL_TYPE

    def __init__(self, config: RunConfig) -> None:
        self.module, self.kwargs = config.model.module, dict(config.model.kwargs)

    def save_pretrained(self, out_dir: Path) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / MODULE_FILE).write_text(json.dumps(
            {"orchestrate_module": self.module, "kwargs": self.kwargs}, indent=1) + "\n")


def model_config(model: nn.Module, config: RunConfig) -> Any:
    """What a saved model directory's config.json comes from: the HF config, or the module's description."""
    return ModuleConfig(config) if is_custom(config) else model.config

