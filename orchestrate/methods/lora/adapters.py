"""What `train.method: lora | qlora` changes in the model states, from the config and the shape alone:
the adapted linears, the trainable adapter parameters and how the frozen base is stored. Pure.

The memory terms that use it are in `memory.py` (the method's terms: `method.py`); the model transform is
`orchestrate/methods/lora/transform.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem, UserError
from orchestrate.model.linears import block_linears, linear_families
from orchestrate.model.shape import ModelShape

NF4_BITS = 4
"""Bits per weight of 4-bit NormalFloat (Dettmers et al. 2023, "QLoRA", section 3)."""

NF4_BLOCK = 64
"""Weights per quantization block, each with one absmax constant (QLoRA section 3; bitsandbytes
`Linear4bit` default blocksize 64)."""

NF4_DOUBLE_QUANT_BLOCK = 256
"""Double quantization: the fp32 absmax constants are themselves quantized to 8 bits in blocks of 256,
each with one fp32 constant: 8/64 + 32/(64*256) = 0.127 bits per weight instead of 32/64 = 0.5
(QLoRA section 3, "Double Quantization"), so NF4 with double quantization is ~4.127 bits per weight."""


def nf4_bits_per_param(double_quant: bool) -> float:
    if double_quant:
        return NF4_BITS + 8 / NF4_BLOCK + 32 / (NF4_BLOCK * NF4_DOUBLE_QUANT_BLOCK)
    return NF4_BITS + 32 / NF4_BLOCK


# (backend, ZeRO stage) pairs whose engines train each method, without offload, verified on 2 gloo ranks
# (DDP; FSDP2 full shard, ZeRO-2, ZeRO-3: docs/measurements.md#methodsloraadapterspy). Others (ZeRO-1,
# FSDP2 shard-grad-op: never run with adapters) are refused.
_VERIFIED = (("ddp", 0), ("fsdp", 3), ("deepspeed", 2), ("deepspeed", 3))
TRAINABLE_ON = {"lora": _VERIFIED, "qlora": _VERIFIED}
# (backend, ZeRO stage, offload_optimizer, offload_params) verified with offload (2 gloo ranks): ZeRO-2/3
# with the adapters' optimizer in host memory, and ZeRO-3 with the frozen base's partitions there too,
# fsdp_qlora's layout. Parameter offload needs optimizer offload (search.py); FSDP2's CPUOffloadPolicy and
# NVMe are not run.
_OFFLOADED = (("deepspeed", 2, "cpu", "none"), ("deepspeed", 3, "cpu", "none"), ("deepspeed", 3, "cpu", "cpu"))
TRAINABLE_OFFLOADED = {"lora": _OFFLOADED, "qlora": _OFFLOADED}


def verified_shardings(method: str) -> frozenset[tuple[str, int, str, str]]:
    """(backend, zero_stage, offload_optimizer, offload_params) `method`'s adapters are verified to train under."""
    return frozenset({(backend, stage, "none", "none") for backend, stage in TRAINABLE_ON[method]}
                     | set(TRAINABLE_OFFLOADED[method]))


def _where(method: str) -> str:
    stages: dict[str, list[str]] = {}
    for backend, stage in TRAINABLE_ON[method]:
        stages.setdefault(backend, []).append(str(stage))
    offloaded = "; with offload only " + ", ".join(
        f"{b} zero_stage {z} with offload {o} and offload_params {p}" for b, z, o, p in TRAINABLE_OFFLOADED[method])
    return ", ".join(f"{b} (zero_stage {' or '.join(z)})" for b, z in stages.items()) + offloaded


def _backend_problems(config: RunConfig) -> list[Problem]:
    """Pins that no verified (backend, stage, offload) of the method matches: one error naming what works."""
    method, pins = config.train.method, config.strategy
    offload = pins.offload not in ("auto", "none") or pins.offload_params is True

    def pinned_ok(backend: str, stage: int) -> bool:
        return pins.backend in ("auto", backend) and pins.zero_stage in ("auto", stage)

    verified = [(b, z) for b, z in TRAINABLE_ON[method] if pinned_ok(b, z)]
    offloaded = [(b, z, o, p) for b, z, o, p in TRAINABLE_OFFLOADED[method] if pinned_ok(b, z)
                 and pins.offload in ("auto", o) and pins.offload_params in ("auto", p != "none")]
    if (verified and not offload) or offloaded:
        return []
    pinned = {k: v for k, v in pins.model_dump().items()
              if k in ("backend", "zero_stage", "offload", "offload_params") and v not in ("auto", False)}
    where = "strategy.offload" if verified else "strategy.backend" if pins.backend != "auto" else "strategy.zero_stage"
    return [Problem(where, f"{method} is not verified to train with {pinned}",
                    f"{method} trains under {_where(method)}: pin one of those, or set the pins to auto")]


@dataclass(frozen=True)
class Adapters:
    method: str
    """lora or qlora."""
    trainable: int
    """Adapter parameters: r * (d_in + d_out) per adapted linear (A: r x d_in, B: d_out x r; Hu et al.
    2021), over every block."""
    quantized: int
    """Base parameters stored in NF4 (the weights of every block linear; 0 for lora)."""
    base_bits_quantized: float
    """Bits per quantized weight (constants included)."""
    largest_linear: int
    """Weights of the largest block linear: what QLoRA dequantizes at once for its matmul."""
    block_trainable: int
    block_quantized: int
    adapted: tuple[str, ...] = ()
    """Names of the adapted block linears (peft target_modules, resolved)."""
    dropout: float = 0.0
    """peft lora_dropout: above 0 each adapter keeps its own dropped copy of its input."""
    dtype_bytes: int = 4
    """Bytes per element of the adapters and their optimizer states (train.lora.dtype)."""


def _problems(config: RunConfig, shape: ModelShape) -> list[Problem]:
    train = config.train
    out = []
    # "Set" = differs from the default: a config dumped whole (RUN_DIR/config.yaml, plan.json) lists
    # every section, so model_fields_set would flag the defaults too.
    if train.method == "full" and train.lora != type(train.lora)():
        out.append(Problem("train.lora", "is set but train.method is full: the adapters would be ignored",
                           "set train.method: lora (or qlora), or remove train.lora"))
    if train.method != "qlora" and train.quantization != type(train.quantization)():
        out.append(Problem("train.quantization", f"is set but train.method is {train.method}: only qlora "
                           "quantizes the base", "set train.method: qlora, or remove train.quantization"))
    if train.method == "full" or out:
        return out
    linears = block_linears(shape)
    if linears is None:
        out.append(Problem("train.method", f"LoRA is planned for the {', '.join(linear_families())} families, "
                           f"not {shape.model_type}", "use method: full"))
        return out
    names = sorted({name for name, _, _ in linears})
    wanted = train.lora.target_modules
    if wanted != "auto" and (unknown := [n for n in wanted if n not in names]):
        out.append(Problem("train.lora.target_modules", f"{', '.join(unknown)} match(es) no linear layer of a "
                           f"{shape.model_type} block", f"use some of {', '.join(names)}, or auto"))
    return out + _backend_problems(config)


def adapters_for(config: RunConfig, shape: ModelShape) -> Adapters | None:
    """The adapters a plan trains (None for full fine-tuning), or the UserError naming bad settings."""
    if problems := _problems(config, shape):
        raise UserError("Cannot plan this run: the fine-tuning settings do not fit the model", problems)
    train = config.train
    if train.method == "full":
        return None
    linears = block_linears(shape) or []
    wanted = train.lora.target_modules
    adapted = [(n, i, o) for n, i, o in linears if wanted == "auto" or n in wanted]
    block_trainable = sum(train.lora.r * (i + o) for _, i, o in adapted)
    block_weights = sum(i * o for _, i, o in linears)
    qlora = train.method == "qlora"
    return Adapters(method=train.method, trainable=shape.num_layers * block_trainable,
                    quantized=shape.num_layers * block_weights if qlora else 0,
                    base_bits_quantized=nf4_bits_per_param(train.quantization.double_quant) if qlora else 0.0,
                    largest_linear=max(i * o for _, i, o in linears),
                    block_trainable=block_trainable, block_quantized=block_weights if qlora else 0,
                    adapted=tuple(sorted({n for n, _, _ in adapted})), dropout=train.lora.dropout,
                    dtype_bytes=2 if train.lora.dtype == "bf16" else 4)
