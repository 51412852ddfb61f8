"""`orchestrate export RUN_DIR --out DIR [--step N]`: a consolidated Hugging Face model
(model.safetensors + config.json + the run's tokenizer, the byte tokenizer as tokenizer.json)
from any checkpoint of a run, offline, in this one process on the CPU: no process group, no GPU.
A LoRA / QLoRA run's checkpoints hold its adapters: `--merge` re-reads the frozen base and merges them in.
`--format gguf [--quant f16|q8_0]`: the same model as one GGUF file for llama.cpp and Ollama
(orchestrate.gguf_export).

Each backend reads its own checkpoints (`Backend.full_state_dict`: DeepSpeed's zero_to_fp32, the
model entries of FSDP2's DCP shards, DDP's trainer_state.pt), every file with weights_only=True
(orchestrate.backends.safe_load).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate import gguf_export
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


FORMATS = ("hf", "gguf")


def check_export_dir(out_dir: Path, fmt: str = "hf") -> None:
    """UserError unless `out_dir` is new, empty, or an earlier export (it has EXPORT_MARKER_FILE):
    export never replaces files it did not write."""
    writes = ("config.json, model.safetensors and tokenizer files" if fmt == "hf"
              else f"{gguf_export.GGUF_FILE} and {gguf_export.MODELFILE}")
    check_output_dir(out_dir, EXPORT_MARKER_FILE, writes)


def _check_format(fmt: str, quant: str | None) -> str | None:
    """The GGUF quantization to write (f16 unless `quant`; None for hf). UserError for an unknown
    format or quantization, a quantization of the HF format, or GGUF without the gguf package."""
    if fmt not in FORMATS:
        raise UserError(f"unknown export format {fmt!r}", [Problem(
            "--format", f"one of {', '.join(FORMATS)}", "--format hf or --format gguf")])
    if fmt == "hf":
        if quant is not None:
            raise UserError("--quant is for GGUF", [Problem(
                "--quant", "the Hugging Face export keeps the checkpoint's precision",
                "add --format gguf, or drop --quant")])
        return None
    if (quant or gguf_export.QUANTS[0]) not in gguf_export.QUANTS:
        raise UserError(f"unknown GGUF quantization {quant!r}", [Problem(
            "--quant", f"one of {', '.join(gguf_export.QUANTS)}", "--quant f16 or --quant q8_0")])
    gguf_export.check_gguf_installed()
    return quant or gguf_export.QUANTS[0]


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
                      say: Callable[[str], None] = _stderr, merge: bool = False, fmt: str = "hf",
                      quant: str | None = None) -> Path:
    """Write the HF model of `run_dir`'s newest intact checkpoint (or of `step`) to `out_dir`;
    returns the checkpoint directory it came from. Damaged newer checkpoints are named to `say`
    and skipped. `merge`: a LoRA / QLoRA run's adapters merged into its base (the only way to export one).
    `fmt` "gguf": model.gguf + an Ollama Modelfile instead, its tensors `quant` (f16, q8_0; f16 unless given).
    A run may still be training: a checkpoint its pruning removes while it is read is replaced by
    the newest intact one then (not with `step`: that one is gone)."""
    from orchestrate.backends.hf_io import save_hf_dir

    quant = _check_format(fmt, quant)
    check_export_dir(Path(out_dir), fmt)
    for attempt in range(_ATTEMPTS):
        found = find_checkpoint(Path(run_dir), step)
        for line in found.notices():
            say(line)
        ckpt = found.chosen.path
        try:
            plan, hf_config, layout, wanted = _read_checkpoint(ckpt, Path(run_dir), merge, fmt)
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
        if fmt == "hf":
            save_hf_dir(wanted, hf_config, out_dir, layout)
            _save_tokenizer(plan, out_dir)
        else:
            with tempfile.TemporaryDirectory() as staged:  # the GGUF's metadata reads the saved tokenizer files
                _save_tokenizer(plan, Path(staged))
                gguf_export.write_gguf(wanted, hf_config, Path(staged), out_dir, quant, say)
    return ckpt


def _save_tokenizer(plan, directory: Path) -> None:
    """The run's tokenizer (None: the byte tokenizer) with the run's chat template from the YAML."""
    from orchestrate.data.chat_template import saved_chat_template
    from orchestrate.data.tokenizer import save_tokenizer
    from orchestrate.data.tokenizer_choice import tokenizer_dir_of

    save_tokenizer(tokenizer_dir_of(plan.config), directory, saved_chat_template(plan.config),
                   plan.config.model.trust_remote_code)


def _read_checkpoint(ckpt: Path, run_dir: Path, merge: bool, fmt: str = "hf"):
    """(plan, HF config, state layout, the model's tensors) of one checkpoint, read into memory; for
    `fmt` gguf, a family GGUF does not cover is refused before the tensors are read."""
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
    if fmt == "gguf":
        gguf_export.check_family(hf_config)
    state = read_model_state(ckpt)
    if merge:
        state = _merged(plan, run_dir, state)
    missing = sorted(set(layout.tensors) - layout.aliases - set(state))
    if missing:
        raise UserError("the checkpoint does not hold the whole model", [Problem(
            str(ckpt), f"missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}",
            "export a checkpoint written by this run's model")])
    return plan, hf_config, layout, {k: state[k] for k in layout.tensors if k in state}  # drops DeepSpeed's extra buffers
