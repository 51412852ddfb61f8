"""The sub-sections of `train:`: optimizer, schedule, LoRA adapters and the quantized base."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from orchestrate.config.sections_base import MAX_COUNT, Section


class OptimizerSection(Section):
    name: Literal["adamw", "adamw8bit", "auto"] = "adamw"
    """adamw: torch AdamW, fp32 states (8 B/param; DeepSpeed's CPU Adam when offloaded). adamw8bit:
    bitsandbytes AdamW8bit, block-wise 8-bit states (about 2 B/param; DDP only, docs/memory-knobs.md).
    auto: adamw8bit only where adamw does not fit."""

    @field_validator("name")
    @classmethod
    def _library(cls, v: str) -> str:
        from orchestrate.config.finetune_deps import OPTIMIZER_LIBRARIES, installed

        if not installed(OPTIMIZER_LIBRARIES[v]):
            raise ValueError(f"optimizer {v} needs bitsandbytes, not installed: run `pip install 'orchestrate[lora]'` "
                             "or use name: adamw")
        return v

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


class LoraSection(Section):
    r: int = Field(default=16, gt=0, le=65536)
    """Rank of each adapter: A is r x d_in, B is d_out x r (Hu et al. 2021, "LoRA")."""

    alpha: float = Field(default=32.0, gt=0)
    """Scaling numerator: the adapter's output is multiplied by alpha / r (peft `lora_alpha`)."""

    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input (peft `lora_dropout`)."""

    dtype: Literal["fp32", "bf16"] = "fp32"
    """The adapters' weights, gradients and Adam states: fp32 (4 + 4 + 8 B per parameter, the default) or
    bf16 (2 + 2 + 4: torch's AdamW keeps its states in the parameter's dtype), as recipes that cast the
    whole model to bf16 train them (Answer.AI fsdp_qlora `--precision bf16`)."""

    target_modules: list[str] | Literal["auto"] = "auto"
    """Names of the linear layers to adapt (peft `target_modules`, matched against the module
    name's last part, e.g. [q_proj, v_proj]); "auto": every linear layer of the blocks."""

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, list) and (not v or any(not name for name in v)):
            raise ValueError('target_modules needs at least one non-empty name, or "auto"')
        return v


class QuantizationSection(Section):
    type: Literal["nf4"] = "nf4"
    """How the frozen base of `method: qlora` is stored: 4-bit NormalFloat (bitsandbytes `Linear4bit`,
    Dettmers et al. 2023, "QLoRA")."""

    double_quant: bool = True
    """Quantize the per-block scales too (about 0.127 instead of 0.5 extra bits per parameter)."""

    compute_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """The dtype the 4-bit weights are dequantized to for each matmul; "auto" is the training precision."""
