"""LoRA and QLoRA (`train.method: lora | qlora`): low-rank adapters train on a frozen base, stored in
the training precision or in 4-bit NF4. A base method (orchestrate/methods/spec.py).

Its files: config.py (`train.lora`, `train.quantization`), adapters.py (what the config and the shape
make of it, the checks), memory.py and offload.py (its memory and speed terms), transform.py (the
model transform), loading.py and quantized_loading.py (how each backend loads its base), saving.py
(the adapter and the merged model), runtime.py (the worker half).
"""

from __future__ import annotations

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.methods.lora.adapters import Adapters, adapters_for, verified_shardings
from orchestrate.methods.lora.memory import (
    adapter_saved_delta,
    adapter_state_scale,
    frozen_base_bytes,
    fsdp_forward_start_bytes,
    quantized_load_bytes,
    trainable_shape,
)
from orchestrate.methods.lora.offload import base_h2d_bytes
from orchestrate.methods.lora.speed import quantized_linear_seconds
from orchestrate.methods.spec import Method
from orchestrate.model.shape import ModelShape
from orchestrate.planner import software_terms
from orchestrate.planner.memory import compute_bytes, shard_group_size
from orchestrate.planner.strategy import Strategy
from orchestrate.planner.terms import Alternative, MethodTerms, PricedTerms
from orchestrate.run.layout import ADAPTER_DIR


def adapter_terms(adapters: Adapters, shape: ModelShape) -> MethodTerms:
    """A LoRA / QLoRA plan: the adapters' states as a small model of their own (`trained`, in
    train.lora.dtype: `state_scale`) under the shardings they are verified on, offloaded ones ranked
    last (verified on CPU only: offload.py); per candidate the frozen base beside them (memory.py), what
    the adapters save per block, its host-to-device copies when offloaded (offload.py) and QLoRA's 4-bit
    linears' seconds (speed.py)."""

    def priced(terms: MethodTerms, hw: HardwareProfile, strategy: Strategy, seq_len: int,
               accumulation: int) -> PricedTerms:
        c, n = compute_bytes(strategy), shard_group_size(hw, strategy)
        # a QLoRA base of older bitsandbytes keeps each 4-bit linear's input (software_terms.py)
        base_saves_input = adapters.quantized > 0 and software_terms.bnb_saves_4bit_input(hw.software)
        return PricedTerms(
            state_scale=adapter_state_scale(strategy, adapters),
            frozen=frozen_base_bytes(shape, strategy, n, adapters, c),
            saved_bytes=adapter_saved_delta(shape, adapters, c, base_saves_input),
            before_activations=fsdp_forward_start_bytes(shape, strategy, adapters, c),
            load_bytes=_load_bytes(shape, hw, strategy, adapters),
            transfer_seconds=(base_h2d_bytes(shape, strategy, n, adapters, c, accumulation) / hw.gpu.pcie_bandwidth
                              if hw.has_gpu else 0.0),
            compute_seconds=(accumulation * quantized_linear_seconds(shape, strategy)
                             if hw.has_gpu and adapters.quantized else 0.0))

    return MethodTerms(trained=trainable_shape(shape, adapters), freezes_base=True,
                       shardings=verified_shardings(adapters.method), offloaded_last=True, priced=priced)


def _load_bytes(shape: ModelShape, hw: HardwareProfile, strategy: Strategy, adapters: Adapters) -> float | None:
    """Host bytes of a node while the base loads; None: as full training loads it (then cast)."""
    c = compute_bytes(strategy)
    if adapters.quantized:
        return quantized_load_bytes(shape, hw.ranks_per_node, c, strategy, adapters)
    if strategy.backend == "ddp":
        return None
    # A LoRA run's 16-bit base is read whole in the compute dtype and transformed (peft renames the keys
    # the sharded loaders fill): under FSDP2 by rank 0 alone, which broadcasts it into the shards; under
    # DeepSpeed by every rank (loading.py; QLoRA: memory.quantized_load_bytes).
    return (1 if strategy.backend == "fsdp" else hw.ranks_per_node) * c * shape.parameters


class Lora(Method):
    name = "lora"
    base = True
    runtime = "orchestrate.methods.lora.runtime"
    saves = (ADAPTER_DIR,)
    trains_adapters = True

    def active(self, config: RunConfig) -> bool:
        return config.train.method in ("lora", "qlora")

    def terms(self, config: RunConfig, shape: ModelShape, hw: HardwareProfile,
              auxiliary: dict[str, ModelShape]) -> MethodTerms:
        return adapter_terms(adapters_for(config, shape), shape)  # a UserError for adapters the model cannot take

    def alternatives(self, config: RunConfig) -> list[Alternative]:
        if config.train.method != "full":
            return []
        words = {"lora": "LoRA adapters on a frozen base", "qlora": "LoRA adapters on a frozen NF4 (4-bit) base"}
        return [Alternative("train.method", words[method], f"train.method: {method}",
                            config.model_copy(update={"train": config.train.model_copy(update={"method": method})}))
                for method in ("lora", "qlora")]

    def simulation_refusal(self, config: RunConfig) -> Problem | None:
        if config.train.method != "qlora":
            return None
        return Problem(  # bitsandbytes' Params4bit cannot re-type a FakeTensor
            "train.method", "the fake-tensor simulation cannot hold a 4-bit base: bitsandbytes' Params4bit is a "
            "tensor subclass that refuses fake tensors and its kernels read real data (bench/qlora_pieces.py "
            "checks QLoRA's terms piece by piece instead)", "simulate method: lora, or drop --simulate")


LORA = Lora()
