"""LoRA's sections of `train:`: the adapters (`train.lora`) and how QLoRA stores the frozen base
(`train.quantization`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from orchestrate.config.section import Section


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
