"""A model's shape without weights: family formulas when they cover the config, else a meta build.

`shape_for` first tries `orchestrate.model.formulas` on the config.json dict (no torch, no
transformers: `orchestrate plan` stays well under a second). Other models are built on the meta
device and counted: the meta device allocates no memory, so even a 70B model is built and counted in
a fraction of a second, and the counts are exact because they come from the real transformers
modules. torch and transformers are imported inside the functions that build, never at import time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem, UserError
from orchestrate.methods.custom.activations import custom_shape
from orchestrate.model.formulas import shape_from_dict
from orchestrate.model.shape import ModelShape
from orchestrate.model.tasks import auto_class, task_of_architectures
from orchestrate.run.layout import RunDir

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig


def _config_errors() -> tuple[type[Exception], ...]:
    """What transformers raises for a bad config value (imported late: it pulls huggingface_hub)."""
    try:  # transformers 5 validates config fields through huggingface_hub's strict dataclasses
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # huggingface_hub < 0.32 (transformers 4.x), which never raises it
        return (ValueError,)
    return (ValueError, StrictDataclassError)


# A Hub repo id: "name" or "org/name" (huggingface_hub's validate_repo_id allows [\w.-]).
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_FAMILIES = "gpt2, llama, mistral, qwen2, phi3"


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _from_architecture(arch: dict) -> PretrainedConfig:
    # Built-in model types only (checked below), so no remote code is involved here.
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    where = "model.architecture"
    model_type = arch["model_type"]  # the schema guarantees the key
    if model_type not in CONFIG_MAPPING:
        raise UserError("unknown model architecture", [Problem(
            f"{where}.model_type", f"transformers does not know model_type {model_type!r}",
            f"use one it knows, e.g. {_FAMILIES}; or point model.name_or_path at a directory "
            "whose config.json maps custom code (with trust_remote_code: true)")])
    kwargs = {k: v for k, v in arch.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **{**_ids_outside_vocabulary(CONFIG_MAPPING[model_type], kwargs),
                                                   **kwargs})
    except (TypeError, *_config_errors()) as exc:
        raise UserError("invalid model architecture", [Problem(
            where, " ".join(str(exc).split()), "fix the value named above")]) from None


SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""The config fields of a model's special tokens (transformers' names), which generation reads."""


def _ids_outside_vocabulary(config_class, kwargs: dict) -> dict[str, None]:
    """None for each special-token id the architecture leaves to the family's default when that
    default lies outside its vocabulary: GPT-2's 50256 in a 640-token model would be saved as its
    EOS (the worker gives the run's tokenizer's ids instead: loading/init_weights.py)."""
    defaults = config_class()
    vocab = kwargs.get("vocab_size", getattr(defaults, "vocab_size", None))
    if not isinstance(vocab, int) or isinstance(vocab, bool):
        return {}
    return {name: None for name in SPECIAL_TOKEN_IDS if name not in kwargs
            and isinstance(default := getattr(defaults, name, None), int) and not 0 <= default < vocab}


def local_model_gone(name: str, path: Path, was_local: bool = False,
                     where: str = "model.name_or_path") -> UserError | None:
    """The error for a `model.name_or_path` that is a local directory and is not there, None when it
    is there or may be a Hub id. Local: `was_local` (a run found a directory there:
    loading/init_weights.py `base_model_gone`), or a name no Hub repo id has (absolute, ./, ~). A
    moved or deleted base is said to be gone from where it was, not looked up on the Hub."""
    if path.exists() or (not was_local and _HUB_NAME.match(name) and not Path(name).expanduser().is_absolute()):
        return None
    return UserError("the model directory is not there", [Problem(
        where, f"{path} does not exist (moved or deleted?): the model is read from that local directory",
        "put the model directory back at that path (or a link to where it is now); in a new config, check the "
        "path (relative paths start at the YAML file's directory)")])


def base_model_gone(config: RunConfig, run_dir: Path) -> UserError | None:
    """The error for a run whose local base model directory is no longer where the run read it (None:
    it is there, or the base is a Hub model). The run's config.yaml names a local base by its
    absolute path (launch/rundir.py `resolved_config_dict`); plan.json keeps the name as written,
    which ("models/tiny") could also be a Hub repo id."""
    name = config.model.name_or_path
    if name is None:
        return None
    try:
        written = yaml.safe_load(RunDir(Path(run_dir)).config.read_text())["model"]["name_or_path"]
    except (OSError, yaml.YAMLError, TypeError, KeyError):
        written = None
    was_local = isinstance(written, str) and Path(written).is_absolute()
    return local_model_gone(name, Path(written) if was_local else config.resolve_path(name), was_local)

def _from_name_or_path(config: RunConfig) -> PretrainedConfig:
    from transformers import AutoConfig

    where = "model.name_or_path"
    name = config.model.name_or_path
    assert name is not None  # internal invariant: the schema requires name_or_path or architecture
    path = config.resolve_path(name)
    local = path.exists()
    if local:
        if not (path / "config.json").is_file():
            raise UserError("model directory has no config.json", [Problem(
                where, f"{path} is not a directory holding a transformers config.json",
                "point it at a model directory (config.json is enough for planning; weights are "
                "needed only to fine-tune), or use model.architecture for a model from scratch")])
        source = str(path)
    elif (gone := local_model_gone(name, path)) is not None:
        raise gone
    else:
        source = name
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=config.model.trust_remote_code)
    except OSError as exc:
        if not local:
            message = (f"{name!r} is not a local directory ({path} does not exist) and could not be "
                       f"fetched from the Hugging Face Hub: {_first_line(exc)}")
            fix = "download the model (or just its config.json) into a local directory and point to it"
        else:
            message, fix = f"cannot read {path / 'config.json'}: {_first_line(exc)}", "repair or replace the file"
        raise UserError("cannot load the model config", [Problem(where, message, fix)]) from None
    except _config_errors() as exc:
        # Unknown model_type, custom code without trust_remote_code, or an invalid field value.
        raise UserError("cannot load the model config", [Problem(
            where, _first_line(exc),
            f"use a model transformers knows ({_FAMILIES}, ...); set model.trust_remote_code: true only "
            "if the directory's own code is trusted")]) from None


def load_model_config(config: RunConfig) -> PretrainedConfig:
    """The transformers config of `config.model`: inline `architecture`, a local directory, or a Hub name."""
    if config.model.architecture is not None:
        return _from_architecture(config.model.architecture)
    return _from_name_or_path(config)


def build_meta_model(hf_config: PretrainedConfig, *, task: str = "causal-lm",
                     trust_remote_code: bool = False) -> nn.Module:
    """The model `task` builds for `hf_config` (orchestrate.model.tasks) with every tensor on the
    meta device (no memory, no init)."""
    # Not accelerate's `init_empty_weights`: under transformers 5 it breaks weight tying (lm_head no
    # longer *is* wte, so a tied head is counted twice: docs/measurements.md#modelmetapy); the
    # torch.device("meta") context keeps tied parameters one object.
    import torch

    try:
        with torch.device("meta"):
            return auto_class(task).from_config(hf_config, trust_remote_code=trust_remote_code)
    except _config_errors() as exc:
        # No class of this task for this model_type (e.g. t5, or gpt2 for masked-lm), or the
        # modules reject a dimension.
        raise UserError("cannot build the model", [Problem(
            "model", _first_line(exc), f"use a model_type that has a {task} model in transformers "
            f"({_FAMILIES}, ...; bert for masked-lm), or another model.task")]) from None


def _count(params: dict[int, nn.Parameter]) -> int:
    return sum(p.numel() for p in params.values())


def _params(module: nn.Module) -> dict[int, nn.Parameter]:
    # Keyed by identity: tied weights are one Parameter object; data_ptr() is 0 for every meta tensor.
    return {id(p): p for p in module.parameters()}


def _blocks(model: nn.Module, num_layers: int, model_type: str) -> nn.ModuleList:
    """The stack of transformer blocks (gpt2: transformer.h, llama/mistral/qwen2/phi3: model.layers)."""
    from torch import nn

    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers]
    if not stacks:
        raise UserError("unsupported model layout", [Problem(
            "model", f"no list of {num_layers} transformer blocks found in the {model_type} model",
            f"use a decoder-only model with a stack of blocks ({_FAMILIES}, ...)")])
    return max(stacks, key=lambda s: _count(_params(s)))


def _attr(cfg: PretrainedConfig, name: str) -> int:
    """A dimension every supported family sets (under its own name via `attribute_map`, e.g. gpt2's n_embd)."""
    value = getattr(cfg, name, None)
    if value is None:
        raise UserError("unsupported model config", [Problem(
            "model", f"a {cfg.model_type} config has no {name}", f"use a supported family ({_FAMILIES}, ...)")])
    return int(value)


def shape_from_config(hf_config: PretrainedConfig, *, task: str = "causal-lm",
                      trust_remote_code: bool = False) -> ModelShape:
    """Exact parameter counts and dimensions of the model `task` builds from `hf_config`."""
    model = build_meta_model(hf_config, task=task, trust_remote_code=trust_remote_code)
    hidden = _attr(hf_config, "hidden_size")
    heads = _attr(hf_config, "num_attention_heads")
    num_layers = _attr(hf_config, "num_hidden_layers")
    blocks = _blocks(model, num_layers, hf_config.model_type)

    in_blocks = _params(blocks)
    embedding: dict[int, nn.Parameter] = {}
    from torch import nn

    for m in model.modules():  # token embedding plus learned positions (gpt2's wpe), outside the blocks
        if isinstance(m, nn.Embedding):
            embedding.update({k: p for k, p in _params(m).items() if k not in in_blocks})
    # A classifier has no output embedding: its head (pooler, classifier) is counted with the rest.
    output = model.get_output_embeddings()
    lm_head = {k: p for k, p in _params(output).items() if k not in embedding} if output is not None else {}
    # DeepSpeed's largest_layer_params: parameters held directly by one module
    # (deepspeed/runtime/zero/stage3.py, model_to_params used by estimate_zero3_model_states_mem_needs_all_live).
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())

    if hasattr(hf_config, "n_inner"):  # GPT-2 family: n_inner null means 4 * n_embd (GPT2Block in modeling_gpt2.py)
        intermediate = hf_config.n_inner or 4 * hidden
    else:
        intermediate = _attr(hf_config, "intermediate_size")
    return ModelShape(
        model_type=hf_config.model_type,
        parameters=_count(_params(model)),
        largest_layer_parameters=largest,
        embedding_parameters=_count(embedding),
        lm_head_parameters=_count(lm_head),
        block_parameters=max(_count(_params(b)) for b in blocks),  # the largest, should blocks differ
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,  # absent or null: plain MHA
        head_dim=getattr(hf_config, "head_dim", None) or hidden // heads,
        intermediate_size=intermediate,
        vocab_size=_attr(hf_config, "vocab_size"),
        max_position_embeddings=_attr(hf_config, "max_position_embeddings"),
        tied_embeddings=output is not None and output.weight is model.get_input_embeddings().weight,
        task=task,
        num_labels=int(hf_config.num_labels) if task == "sequence-classification" else 0,
    )


def config_dict(config: RunConfig) -> dict | None:
    """The config.json mapping when it is at hand without transformers: `model.architecture` or a
    local directory's config.json. None otherwise (Hub names, missing or unreadable files: the
    transformers path reports those)."""
    if config.model.architecture is not None:
        return dict(config.model.architecture)
    path = config.resolve_path(config.model.name_or_path) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def shape_for(config: RunConfig) -> ModelShape:
    """The shape of the model `config` describes (reads at most a config.json; never weights);
    your own `model.module` is counted on the meta device, its activations measured once."""
    if config.model.module is not None:
        return custom_shape(config)
    data = config_dict(config)
    task = config.model.task
    _check_saved_task(data, task)
    # The formulas describe the causal-LM classes; the other tasks' heads are measured on the meta device.
    shape = shape_from_dict(data) if data is not None and task == "causal-lm" else None
    if shape is not None:
        return shape
    hf_config = load_model_config(config)
    if config.model.num_labels is not None:
        hf_config.num_labels = config.model.num_labels
    return shape_from_config(hf_config, task=task, trust_remote_code=config.model.trust_remote_code)


def _check_saved_task(data: dict | None, task: str) -> None:
    """A directory saved by a model of another task (BertForSequenceClassification under the
    default causal-lm) would be built as the wrong class and fail far from the cause."""
    saved = task_of_architectures((data or {}).get("architectures"))
    if saved is not None and saved != task:
        raise UserError("the model directory holds a model of another task", [Problem(
            "model.task", f"its config.json names {', '.join(data['architectures'])} ({saved}), "
            f"model.task is {task}", f"set model.task: {saved}")])
