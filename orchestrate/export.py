"""`orchestrate export RUN_DIR --out DIR [--step N]`: a consolidated Hugging Face model
(model.safetensors + config.json, plus the tokenizer files when the run used a tokenizer directory)
from any checkpoint of a run, offline, in this one process on the CPU: no process group, no GPU.

- DeepSpeed ZeRO 1-3: zero_to_fp32's `get_fp32_state_dict_from_zero_checkpoint` (the fp32 master
  weights, also for bf16/fp16 training); stage 0: the module weights DeepSpeed saved.
- FSDP2: the "model" entries of the DCP checkpoint, read in one process (optimizer shards untouched).
- DDP: trainer_state.pt's "model" (memory-mapped: the optimizer state is never read).
Every file is read with weights_only=True (orchestrate.backends.safe_load).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

from orchestrate.errors import Problem, UserError
from orchestrate.worker.checkpointing import HF_CONFIG, PLAN_COPY, find_checkpoint, read_meta


def _deepspeed_state(ckpt: Path, zero_stage: int) -> dict[str, torch.Tensor]:
    from orchestrate.backends.deepspeed_backend import _CKPT_TAG
    from orchestrate.backends.safe_load import deepspeed_checkpoint_classes, weights_only_loads

    with weights_only_loads(deepspeed_checkpoint_classes()):
        if zero_stage == 0:  # no ZeRO partitions: the module's own (fp32 or 16-bit) weights
            return torch.load(ckpt / _CKPT_TAG / "mp_rank_00_model_states.pt", map_location="cpu")["module"]
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(io.StringIO()):
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=_CKPT_TAG)


def _fsdp_state(ckpt: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(ckpt))
    prefix = "model."  # FSDPEngine.save_checkpoint saves {"model": ..., "optim": ...}
    state = {key[len(prefix):]: torch.empty(md.size, dtype=md.properties.dtype)
             for key, md in reader.read_metadata().state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    return state


def _ddp_state(ckpt: Path) -> dict[str, torch.Tensor]:
    from orchestrate.backends.ddp import TRAINER_STATE_FILE

    return torch.load(ckpt / TRAINER_STATE_FILE, map_location="cpu", weights_only=True, mmap=True)["model"]


def read_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The full, unsharded model state dict of a checkpoint directory, on the CPU."""
    meta = read_meta(ckpt)
    backend = meta["backend"]
    if backend == "deepspeed":
        return _deepspeed_state(ckpt, meta["strategy"]["zero_stage"])
    if backend == "fsdp":
        return _fsdp_state(ckpt)
    if backend == "ddp":
        return _ddp_state(ckpt)
    raise UserError("cannot export this checkpoint", [Problem(str(ckpt), f"unknown backend {backend!r}")])


def export_checkpoint(run_dir: Path, out_dir: Path, step: int | None = None) -> Path:
    """Write the HF model of `run_dir`'s latest checkpoint (or of `step`) to `out_dir`; returns the
    checkpoint directory it came from."""
    from transformers import AutoConfig

    from orchestrate.backends.hf_io import StateLayout, save_hf_dir
    from orchestrate.model.meta import build_meta_model
    from orchestrate.planner.plan import Plan
    from orchestrate.worker.main import _copy_tokenizer

    ckpt = find_checkpoint(Path(run_dir), step)
    plan = Plan.read(ckpt / PLAN_COPY)
    trust = plan.config.model.trust_remote_code
    hf_config = AutoConfig.from_pretrained(ckpt / HF_CONFIG, trust_remote_code=trust)
    layout = StateLayout.of(build_meta_model(hf_config, trust_remote_code=trust))
    state = read_model_state(ckpt)
    missing = sorted(set(layout.tensors) - layout.aliases - set(state))
    if missing:
        raise UserError("the checkpoint does not hold the whole model", [Problem(
            str(ckpt), f"missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}",
            "export a checkpoint written by this run's model")])
    wanted = {k: state[k] for k in layout.tensors if k in state}  # drops non-persistent buffers DeepSpeed lists
    out_dir = Path(out_dir)
    save_hf_dir(wanted, hf_config, out_dir, layout)
    tokenizer = plan.config.data.tokenizer
    if tokenizer and plan.config.resolve_path(tokenizer).is_dir():
        _copy_tokenizer(plan.config.resolve_path(tokenizer), out_dir)
    return ckpt
