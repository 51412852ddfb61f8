"""The initial weights every backend starts from, as one Hugging Face model directory.

A local `model.name_or_path` directory with weights is used as is. Otherwise local rank 0 of each
node builds the model from its config with `torch.manual_seed(train.seed)` in fp32 and saves it to
RUN_DIR/init_model; the other ranks wait at a barrier. The same seed gives bit-identical weights
on every node, so DeepSpeed, FSDP2 and DDP runs of one config start from the same point. A backend
that builds such a model itself (Backend.reads_weights: DDP) gets only its config.json there and
builds it with `build_from_config`, the same seed and the same weights, without a save and a load.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import torch

from orchestrate.backends.deepspeed_import import import_deepspeed_lean
from orchestrate.data.tokenizer import load_tokenizer, special_token_ids
from orchestrate.data.tokenizer_choice import tokenizer_dir_of
from orchestrate.errors import Problem, UserError
from orchestrate.loading.labels import apply_labels
from orchestrate.methods.custom.module import ModuleConfig
from orchestrate.model.meta import base_model_gone, load_model_config
from orchestrate.model.tasks import auto_class
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import INIT_MODEL_DIR

_WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


def has_weights(directory: Path) -> bool:
    return directory.is_dir() and any(any(directory.glob(p)) for p in _WEIGHT_PATTERNS)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _hub_snapshot(name: str, download: bool) -> Path:
    """A Hub model's files in the local cache (downloaded by one rank per node, read by the rest)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors"],
                                      local_files_only=not download))
    except Exception as exc:  # offline, unknown repo, gated: all end the same way for the user
        raise UserError(f"cannot fetch the weights of {name!r}", [Problem(
            "model.name_or_path", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            "download the model into a local directory and point model.name_or_path at it")]) from None


def initial_config(plan: RunPlan, labels: list[str] | None):
    """The transformers config the initial model is built from, with the data's labels for a
    classifier and, for a model built from `model.architecture`, the BOS and EOS ids of the run's
    tokenizer that the architecture does not set: the family's defaults name other tokens (GPT-2's
    50256, outside a 640-token vocabulary), and the saved config.json and generation_config.json
    (derived from it) would carry them. Not the pad id: transformers builds the input embedding with
    `padding_idx=config.pad_token_id` (Llama, Qwen2, Mistral, ...), which zeroes that row and keeps it
    from learning, and a tokenizer's pad is often its EOS, the token every answer trains to end with;
    generation pads with the EOS when no pad is set."""
    hf_config = load_model_config(plan.config)
    architecture = plan.config.model.architecture
    if architecture is not None:
        tokenizer = load_tokenizer(tokenizer_dir_of(plan.config), trust_remote_code=plan.config.model.trust_remote_code)
        for name, value in special_token_ids(tokenizer).items():
            if name not in architecture:
                setattr(hf_config, name, value)
    if labels is not None:
        apply_labels(hf_config, labels)
    return hf_config


def _fresh_model(hf_config, task: str, trust_remote_code: bool):
    """The fp32 model of `hf_config` with fresh weights from torch's generator as it is (the caller
    seeds it)."""
    return auto_class(task).from_config(hf_config, trust_remote_code=trust_remote_code, dtype=torch.float32)


def build_from_config(model_dir: Path, task: str, trust_remote_code: bool):
    """The model of model_dir/config.json, fresh and fp32 (the caller seeds it): what
    `build_initial_model` saves."""
    from transformers import AutoConfig

    return _fresh_model(AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code), task,
                        trust_remote_code)


def _write_atomically(out_dir: Path, write: Callable[[Path], None], done: Callable[[Path], bool]) -> None:
    """`write` into a temporary directory, renamed to out_dir. Unique temp name: on a shared file
    system several nodes may write at once; the first rename wins and the others (identical content)
    are discarded once `done(out_dir)` says the winner's is complete."""
    tmp = out_dir.with_name(f".{out_dir.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    try:
        tmp.rename(out_dir)
    except OSError:
        if not done(out_dir):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _has_config(directory: Path) -> bool:
    return (directory / "config.json").is_file()


def build_initial_model(plan: RunPlan, out_dir: Path, labels: list[str] | None = None) -> Path:
    """Build the model from its config with the run's seed, fp32, and save it atomically to out_dir."""
    torch.manual_seed(plan.config.train.seed)
    model = _fresh_model(initial_config(plan, labels), plan.config.model.task, plan.config.model.trust_remote_code)
    # save_pretrained unwraps the model through accelerate, which imports DeepSpeed (backends/deepspeed_import.py).
    import_deepspeed_lean(keep_mlflow="mlflow" in plan.config.train.report_to)
    _write_atomically(out_dir, model.save_pretrained, has_weights)
    return out_dir


def existing_weights_dir(plan: RunPlan, run_dir: Path) -> Path:
    """The model directory `ensure_initial_weights` gave this run's workers, found again without building or
    downloading (for `orchestrate export --merge`, which re-reads a LoRA run's frozen base)."""
    name = plan.config.model.name_or_path
    if name is not None:
        path = plan.config.resolve_path(name)
        if has_weights(path):
            return path
        if (gone := base_model_gone(plan.config, run_dir)) is not None:
            raise gone
        if not path.exists():
            return _hub_snapshot(name, download=False)
    return Path(run_dir) / INIT_MODEL_DIR



def ensure_initial_weights(plan: RunPlan, run_dir: Path, local_rank: int, labels: list[str] | None = None,
                           weights: bool = True) -> Path:
    """The model directory to load from; collective when a process group is initialised. `labels`:
    a classifier's label names (from the data), which size its head. `weights=False`: a model built
    from its config gets only config.json (the backend builds it: Backend.reads_weights)."""
    name = plan.config.model.name_or_path
    if plan.config.model.module is not None:
        # Your own module is built (and seeded) by the backend; the directory holds only its
        # description (config.json: module path and kwargs), which checkpoints copy.
        out_dir = run_dir / INIT_MODEL_DIR
        if local_rank == 0:
            ModuleConfig(plan.config).save_pretrained(out_dir)
        _barrier()
        return out_dir
    if name is not None:
        path = plan.config.resolve_path(name)
        if has_weights(path):
            return path
        if (gone := base_model_gone(plan.config, run_dir)) is not None:  # moved since the launcher checked it
            raise gone
        if not path.exists():  # a Hub name
            if local_rank == 0:
                _hub_snapshot(name, download=True)
            _barrier()
            snapshot = _hub_snapshot(name, download=False)
            if has_weights(snapshot):
                return snapshot
    out_dir = run_dir / INIT_MODEL_DIR
    if local_rank == 0 and weights and not has_weights(out_dir):
        if _has_config(out_dir):  # only the config of a backend that built the model itself (a re-planned resume)
            shutil.rmtree(out_dir)
        build_initial_model(plan, out_dir, labels)
    elif local_rank == 0 and not weights and not _has_config(out_dir):
        _write_atomically(out_dir, initial_config(plan, labels).save_pretrained, _has_config)
    _barrier()  # the other ranks imported the model's code meanwhile (orchestrate.worker.preload)
    return out_dir
