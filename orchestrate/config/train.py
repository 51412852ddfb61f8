"""The `train:` section (how to train) and its optimizer and learning-rate schedule sub-sections.
The method-specific ones are their methods': `train.lora`, `train.quantization` in
orchestrate/methods/lora/config.py."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_serializer, model_validator

from orchestrate.config.requirements import (
    check_fused_kernels_library,
    check_method_libraries,
    check_optimizer_library,
    check_trackers,
)
from orchestrate.config.section import MAX_COUNT, Auto, Section
from orchestrate.methods.lora.config import LoraSection, QuantizationSection

DEFAULT_OUTPUT_DIR = "runs"
"""Where run directories go when train.output_dir is unset: under the working directory (config.load)."""


class OptimizerSection(Section):
    name: Literal["adamw", "adamw8bit", "auto"] = "adamw"
    """adamw: torch AdamW, fp32 states (8 B/param; DeepSpeed's CPU Adam when offloaded). adamw8bit:
    bitsandbytes AdamW8bit, block-wise 8-bit states (about 2 B/param; DDP only, docs/memory-knobs.md).
    auto: adamw8bit only where adamw does not fit."""

    @field_validator("name")
    @classmethod
    def _library(cls, v: str) -> str:
        return check_optimizer_library(v)

    lr: float = Field(default=3e-4, gt=0)
    """Peak learning rate, reached at the end of warm-up."""

    weight_decay: float = Field(default=0.1, ge=0)
    """Decoupled weight decay (AdamW)."""

    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's (beta1, beta2), each in [0, 1) (torch.optim.AdamW refuses others: torch/optim/adamw.py)."""

    eps: float = Field(default=1e-8, gt=0)
    """Adam's epsilon."""

    @field_validator("betas", mode="before")
    @classmethod
    def _list_to_tuple(cls, v: Any) -> Any:
        # YAML and plan.json have lists; strict mode accepts only a tuple for a tuple field.
        return tuple(v) if isinstance(v, list) else v

    @field_validator("betas")
    @classmethod
    def _betas_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v


class ScheduleSection(Section):
    warmup_steps: int = Field(default=10, ge=0, le=MAX_COUNT)
    """Linear warm-up from 0 to `optimizer.lr` over this many optimizer steps."""

    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    """Cosine decay ends at `lr * min_lr_ratio` on the last step."""


_COUNT_RANGES = {"micro_batch_size": (1, ""), "loss_chunks": (0, "0 (no chunking), "),
                 "mlp_tiles": (0, "0 (one pass), "), "sequence_parallel": (1, "1 (off), ")}
"""The integer-or-auto counts of `train`: (lowest value, what the lowest means where it switches the knob off)."""


class TrainSection(Section):
    loss: Literal["auto", "cross_entropy", "model"] = "auto"
    """`model.module` only: cross_entropy of the output (or its `logits`) against `labels`; model:
    the output's own `loss` (key or attribute), the batch's `labels` passed to the model; auto:
    the model's loss when its output has one, else cross_entropy."""

    seq_len: int = Field(gt=0, le=MAX_COUNT)
    """Tokens per sample (packed block length)."""

    global_batch_size: int = Field(gt=0, le=MAX_COUNT)
    """Samples per optimizer step over all ranks: micro_batch_size x grad accumulation x world size."""

    micro_batch_size: int | Auto = "auto"
    """Samples per rank per forward pass; "auto" lets the planner pick the largest that fits and divides."""

    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Training precision; "auto" is bf16 where the GPU supports it (Ampere and newer), fp16 with
    dynamic loss scaling on Turing, fp32 on CPU-only machines."""

    activation_checkpointing: bool | Auto = "auto"
    """Recompute each block's activations in backward (costs about one extra forward pass)."""

    loss_chunks: int | Auto = "auto"
    """causal-lm: run the LM head + cross-entropy in N chunks over the sequence, each recomputed in
    backward, so the full logits never exist (preference: the answer log-probabilities, docs/preference.md);
    0: one pass; "auto": the planner's choice (docs/memory-knobs.md)."""

    activation_offload: bool | Auto = "auto"
    """GPU, with activation checkpointing: keep each checkpointed block's input in pinned CPU memory
    until backward (torch save_on_cpu); "auto": the planner's choice (docs/memory-knobs.md)."""

    mlp_tiles: int | Auto = "auto"
    """Decoder families with an MLP per block (llama, mistral, qwen2, phi3, gemma, gpt2): compute each
    block's MLP over N slices of the sequence, each recomputed in backward, so its 3.5x-hidden-wide
    intermediates exist for one slice at a time (DeepSpeed's TiledMLP, as ALST); 0: one pass; "auto": the
    planner's choice (docs/long-context.md)."""

    sequence_parallel: int | Auto = "auto"
    """Split each sample's sequence over N ranks (Ulysses: attention exchanges heads for sequence with
    all-to-all, so each rank holds 1/N of every activation); N divides the world size and the attention
    heads; 1: off; "auto": the planner's choice, raised only where one rank cannot hold the sequence
    (docs/long-context.md)."""

    fused_kernels: bool | Auto = "auto"
    """GPU, Llama-style families: Liger-Kernel's fused RMSNorm, RoPE and SwiGLU (Triton), which save less for
    backward than the eager ones; "auto": on where a GPU and liger-kernel are there (docs/long-context.md)."""

    @field_validator("fused_kernels")
    @classmethod
    def _fused_kernels_library(cls, v: bool | str) -> bool | str:
        return check_fused_kernels_library(v)

    embedding_offload: bool | Auto = "auto"
    """GPU, DDP, method lora/qlora, untied embedding: keep the frozen input embedding in host memory (its
    lookup runs there, only the rows go to the GPU); "auto": the planner's choice (docs/memory-knobs.md)."""

    method: Literal["full", "lora", "qlora", "auto"] = "full"
    """full: train every weight. lora: freeze the base, train low-rank adapters on its linear layers
    (peft). qlora: the same on a base stored in 4-bit NF4 (bitsandbytes). auto: the first of full,
    lora, qlora that fits (the plan says which and why)."""

    lora: LoraSection = Field(default_factory=LoraSection)
    """Adapter settings of `method: lora | qlora`."""

    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    """How `method: qlora` stores the frozen base."""

    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    """Optimizer settings."""

    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    """Learning-rate schedule: linear warm-up then cosine decay."""

    max_steps: int | None = Field(default=100, gt=0, le=MAX_COUNT)
    """Optimizer steps to train (100 when neither it nor `num_epochs` is given; give one of the two)."""

    num_epochs: float | None = Field(default=None, gt=0, le=MAX_COUNT, validate_default=True,
                                     exclude_if=lambda v: v is None)
    """Instead of `max_steps`: passes over the training samples, the sampler's: packed blocks of text or
    chat samples when packed, else the samples themselves; preference records (pairs) either way.
    Fractional allowed (0.5: half of them). The steps are ceil(num_epochs x ceil(samples /
    global_batch_size)), as transformers' Trainer counts them (`set_initial_training_values`); the
    samples are known once the data is prepared, so the plan says "steps resolved at prepare" and the
    prepare line and the workers give the number."""

    neftune_noise_alpha: float | None = Field(default=None, gt=0, exclude_if=lambda v: v is None)
    """NEFTune (Jain et al. 2023, "NEFTune: Noisy Embeddings Improve Instruction Finetuning"): add
    uniform noise in [-m, m], m = alpha / sqrt(seq_len x hidden_size), to the input embeddings in
    training forwards only (never at evaluation or generation), as transformers'
    `neftune_post_forward_hook` (TRL's and transformers' name); seq_len is `train.seq_len`, the packed
    block or padded row; the paper uses 5 to 15. null: off. Not with `preference:` or `grpo:`."""

    grad_clip: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""

    seed: int = Field(default=0, ge=0, le=2**32 - 1)
    """Seed for weights, data order and dropout; the same seed reproduces the same losses (0 to 2**32-1,
    the range numpy's seeding accepts)."""

    output_dir: str | None = None
    """Where run directories are created. null: `runs` in the directory the command runs in
    (`orchestrate launch examples/tiny-gpt2.yaml` from ~/proj writes ~/proj/runs/tiny-gpt2-<time>, not
    next to the example); a relative path you write is relative to the YAML file's directory, as
    every path in it is."""

    @field_validator("micro_batch_size", "loss_chunks", "mlp_tiles", "sequence_parallel")
    @classmethod
    def _count_range(cls, v: int | str, info: ValidationInfo) -> int | str:
        lowest, off = _COUNT_RANGES[info.field_name]
        if isinstance(v, int) and not lowest <= v <= MAX_COUNT:
            raise ValueError(f"{info.field_name} must be {off}a positive integer or auto")
        return v

    @field_validator("method")
    @classmethod
    def _adapter_libraries(cls, v: str) -> str:
        return check_method_libraries(v)  # a missing library fails at plan time, not inside the worker

    eval_every: int = Field(default=0, ge=0, le=MAX_COUNT)
    """Evaluate every N steps (0: only at the end)."""

    eval_batches: int = Field(default=4, gt=0, le=MAX_COUNT)
    """Micro-batches per evaluation."""

    eval_generate: int = Field(default=0, ge=0, le=MAX_COUNT)
    """Chat and instruction records: at each evaluation, generate this many held-out answers (greedy) and
    log their exact-match rate against the data's answers (`eval_exact_match`) and the texts
    (`eval_generations`) in metrics.jsonl; 0: none."""

    checkpoint_every: int = Field(default=0, ge=0, le=MAX_COUNT)
    """Write a resumable checkpoint every N steps (0: only at the end)."""

    keep_checkpoints: int = Field(default=2, gt=0, le=MAX_COUNT)
    """How many of the latest checkpoints to keep."""

    oom_retries: int = Field(default=2, ge=0, le=5)
    """When a worker runs out of device memory, re-plan with the measured shortfall added and resume
    from the last checkpoint up to this many times (0: stop at the first; docs/fault-tolerance.md)."""

    preemption_grace_s: int = Field(default=120, gt=0, le=7 * 24 * 3600)
    """Seconds between SIGTERM/SIGUSR1 (preemption, time limit) and the kill. The workers finish the
    current step and checkpoint when the last checkpoint's write time says it fits, else exit at once
    (the previous checkpoint stays); `orchestrate launch` gives torchrun this long before SIGKILL.
    Match it to SLURM's `--signal` lead time."""

    report_to: list[Literal["tensorboard", "wandb", "mlflow", "none"]] = Field(
        default_factory=lambda: ["tensorboard"])
    """Experiment trackers rank 0 logs every step to, under the run directory: tensorboard (RUN_DIR/tb),
    wandb (offline, RUN_DIR/wandb), mlflow (local file store, RUN_DIR/mlruns); ["none"] for none."""

    @field_validator("report_to")
    @classmethod
    def _trackers_installed(cls, v: list[str]) -> list[str]:
        return check_trackers(v)  # a missing library fails here, at plan time, not inside the worker

    @model_validator(mode="before")
    @classmethod
    def _epochs_replace_default_steps(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("num_epochs") is not None and "max_steps" not in data:
            data = {**data, "max_steps": None}
        return data

    @field_validator("num_epochs")
    @classmethod
    def _one_length(cls, v: float | None, info: ValidationInfo) -> float | None:
        if "max_steps" not in info.data:  # max_steps itself failed: its own problem says why
            return v
        steps = info.data["max_steps"]
        if v is not None and steps is not None:
            raise ValueError(f"give train.max_steps ({steps}) or train.num_epochs ({v:g}), not both")
        if v is None and steps is None:
            raise ValueError("give train.max_steps or train.num_epochs: how long to train")
        return v

    @model_serializer(mode="wrap")
    def _as_written(self, handler: Any) -> dict[str, Any]:
        # A worker resolves num_epochs into max_steps over its data (`resolved`); what is written out
        # (plan.json, a checkpoint's plan copy) is the length as the user gave it.
        data = handler(self)
        if self.num_epochs is not None:
            data.pop("max_steps", None)
        return data

    def epoch_steps(self, samples: int) -> int:
        """Optimizer steps of `num_epochs` passes over `samples` training samples: transformers'
        `Trainer.set_initial_training_values` (trainer.py) takes num_update_steps_per_epoch =
        ceil(len(dataloader) / gradient_accumulation_steps), len(dataloader) = ceil(samples /
        (per-device batch x world size)), so ceil(samples / global batch), and max_steps =
        ceil(num_train_epochs x num_update_steps_per_epoch). A step here always takes a whole global
        batch (the sampler runs on into the next epoch where HF's last batch is short)."""
        assert self.num_epochs is not None  # internal invariant: called for epoch-based runs only
        return max(1, math.ceil(self.num_epochs * math.ceil(samples / self.global_batch_size)))

    def resolved(self, samples: int) -> TrainSection:
        """This section with `max_steps` the steps of `num_epochs` over `samples` (the section itself
        when num_epochs is unset). Not validated again, and serialised as written (`_as_written`)."""
        if self.num_epochs is None:
            return self
        return self.model_copy(update={"max_steps": self.epoch_steps(samples)})

    def length(self) -> str:
        """How long the run trains, for people: "100 steps", or "2 epochs (steps resolved at prepare)" /
        "2 epochs = 155 steps" once resolved."""
        if self.num_epochs is None:
            return f"{self.max_steps} steps"
        epochs = f"{self.num_epochs:g} epoch{'' if self.num_epochs == 1 else 's'}"
        return f"{epochs} = {self.max_steps} steps" if self.max_steps is not None else f"{epochs} (steps resolved at prepare)"
