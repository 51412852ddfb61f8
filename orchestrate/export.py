"""`orchestrate export RUN_DIR --out DIR [--step N]`: a consolidated Hugging Face model
(model.safetensors + config.json + the run's tokenizer, the byte tokenizer as tokenizer.json)
from any checkpoint of a run, offline, in this one process on the CPU: no process group, no GPU.
A LoRA / QLoRA run's checkpoints hold its adapters: `--merge` re-reads the frozen base and merges them in.

Each backend reads its own checkpoints (`Backend.full_state_dict`: DeepSpeed's zero_to_fp32, the
model entries of FSDP2's DCP shards, DDP's trainer_state.pt), every file with weights_only=True
(orchestrate.backends.safe_load).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.backends.registry import backend_names, get_backend
from orchestrate.errors import Problem, UserError
from orchestrate.methods.lora.saving import merge_adapters
from orchestrate.methods.registry import base_method
from orchestrate.model.meta import build_meta_model
from orchestrate.planner.plan import RunPlan
from orchestrate.run.checkpoints import HF_CONFIG, PLAN_COPY, engine_errors, find_checkpoint, read_meta
from orchestrate.run.layout import EXPORT_MARKER_FILE, check_output_dir, os_errors_as_user_errors
from orchestrate.run.versions import OtherVersion

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch


def read_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The full, unsharded model state dict of a checkpoint directory, on the CPU."""
    meta = read_meta(ckpt)
    if meta.backend not in backend_names():
        raise UserError("cannot export this checkpoint", [Problem(
            str(ckpt), f"unknown backend {meta.backend!r}", "export it where that backend is installed")])
    try:
        return get_backend(meta.backend).full_state_dict(ckpt, meta)
    except engine_errors() as exc:  # the boundary: whatever the backend's reader raises on damaged files
        raise UserError(f"the checkpoint {ckpt} passed its checks but cannot be read", [Problem(
            str(ckpt), f"{type(exc).__name__}: {exc}", "export an older checkpoint of the run (--step N)")]) from exc


def check_export_dir(out_dir: Path) -> None:
    """UserError unless `out_dir` is new, empty, or an earlier export (it has EXPORT_MARKER_FILE):
    export never replaces files it did not write."""
    check_output_dir(out_dir, EXPORT_MARKER_FILE, "config.json, model.safetensors and tokenizer files")


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _check_merge(plan, ckpt: Path, merge: bool) -> None:
    """A checkpoint of a method that trains adapters on a frozen base (LoRA / QLoRA: `Method.trains_adapters`)
    holds the adapters only: exporting it means merging them (`--merge`)."""
    method = base_method(plan.config)
    if method.trains_adapters and not merge:
        raise UserError("this checkpoint holds LoRA adapters only", [Problem(
            str(ckpt), "the checkpoints of this run keep the trainable adapters, not the frozen base",
            "add --merge: the base is re-read and the adapters merged into it (full precision)")])
    if not method.trains_adapters and merge:
        raise UserError("nothing to merge", [Problem(
            "--merge", f"this run trains every weight ({method.name}): its checkpoints hold no adapters",
            "drop --merge")])


def _merged(plan, run_dir: Path, adapters: dict) -> dict:
    from orchestrate.loading.init_weights import existing_weights_dir

    base = existing_weights_dir(plan, run_dir)
    if not base.is_dir():
        raise UserError("the run's base model is gone", [Problem(
            str(base), "--merge re-reads the frozen base the adapters trained on, and it is not there",
            "restore that directory (model.name_or_path, or RUN_DIR/init_model) and export again")])
    return merge_adapters(plan, base, adapters)[0]


_ATTEMPTS = 5
"""Discoveries before giving up while a run still training prunes the checkpoint being read."""


def export_checkpoint(run_dir: Path, out_dir: Path, step: int | None = None,
                      say: Callable[[str], None] = _stderr, merge: bool = False) -> Path:
    """Write the HF model of `run_dir`'s newest intact checkpoint (or of `step`) to `out_dir`;
    returns the checkpoint directory it came from. Damaged newer checkpoints are named to `say`
    and skipped. `merge`: a LoRA / QLoRA run's adapters merged into its base (the only way to export one).
    A run may still be training: a checkpoint its pruning removes while it is read is replaced by
    the newest intact one then (not with `step`: that one is gone)."""
    from orchestrate.backends.hf_io import save_hf_dir
    from orchestrate.data.chat_template import saved_chat_template
    from orchestrate.data.tokenizer import save_tokenizer
    from orchestrate.data.tokenizer_choice import tokenizer_dir_of

    check_export_dir(Path(out_dir))
    for attempt in range(_ATTEMPTS):
        found = find_checkpoint(Path(run_dir), step)
        for line in found.notices():
            say(line)
        ckpt = found.chosen.path
        try:
            plan, hf_config, layout, wanted = _read_checkpoint(ckpt, Path(run_dir), merge)
            break
        except UserError:
            if ckpt.is_dir() or step is not None or attempt == _ATTEMPTS - 1:
                raise
            say(f"{ckpt} was removed while it was read (the run is still training and keeps only "
                "train.keep_checkpoints): exporting the newest intact checkpoint instead")
    out_dir = Path(out_dir)
    with os_errors_as_user_errors("--out"):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / EXPORT_MARKER_FILE).write_text(f"exported from {ckpt}\n")  # first: ours from now on
        save_hf_dir(wanted, hf_config, out_dir, layout)
        # None: the byte tokenizer; the run's chat template from the YAML saved with it
        save_tokenizer(tokenizer_dir_of(plan.config), out_dir, saved_chat_template(plan.config),
                       plan.config.model.trust_remote_code)
    return ckpt


def _read_checkpoint(ckpt: Path, run_dir: Path, merge: bool):
    """(plan, HF config, state layout, the model's tensors) of one checkpoint, read into memory."""
    from transformers import AutoConfig

    from orchestrate.backends.hf_io import StateLayout

    if not (ckpt / HF_CONFIG).is_file():  # orchestrate.save of a user's own module (docs/own-loop.md)
        raise UserError(f"the checkpoint {ckpt} is not a Hugging Face model", [Problem(
            str(ckpt), f"no {HF_CONFIG}: it was written by orchestrate.save from your own loop's module",
            "restore it in your script with orchestrate.load(), then save the module as you like")])
    try:
        plan = RunPlan.read(ckpt / PLAN_COPY, read_only=True)
        trust = plan.config.model.trust_remote_code
        hf_config = AutoConfig.from_pretrained(ckpt / HF_CONFIG, trust_remote_code=trust)
        layout = StateLayout.of(build_meta_model(hf_config, task=plan.config.model.task, trust_remote_code=trust))
    except OtherVersion:
        raise
    except Exception as exc:  # a checkpoint without a manifest may hold any damage
        raise UserError(f"the checkpoint {ckpt} cannot be read", [Problem(
            str(ckpt), f"{type(exc).__name__}: {exc}", "export an older checkpoint of the run (--step N)")]) from exc
    _check_merge(plan, ckpt, merge)
    state = read_model_state(ckpt)
    if merge:
        state = _merged(plan, run_dir, state)
    missing = sorted(set(layout.tensors) - layout.aliases - set(state))
    if missing:
        raise UserError("the checkpoint does not hold the whole model", [Problem(
            str(ckpt), f"missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}",
            "export a checkpoint written by this run's model")])
    return plan, hf_config, layout, {k: state[k] for k in layout.tensors if k in state}  # drops DeepSpeed's extra buffers
