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
from orchestrate.hardware.software import SoftwareStack
from orchestrate.methods.lora.adapters import Adapters, adapters_for, trains
from orchestrate.methods.lora.memory import (
    adapter_saved_delta,
    adapter_state_scale,
    frozen_base_bytes,
    fsdp_forward_start_excess,
    quantized_load_bytes,
    trainable_shape,
)
from orchestrate.methods.lora.offload import base_h2d_bytes
from orchestrate.methods.lora.speed import quantized_linear_seconds
from orchestrate.methods.spec import Alternative, Method, MethodTerms, PlacedBytes
from orchestrate.model.shape import ModelShape
from orchestrate.planner import software_terms
from orchestrate.planner.memory import compute_bytes, shard_group_size
from orchestrate.planner.strategy import Sharding, Strategy
from orchestrate.run.layout import ADAPTER_DIR


class AdapterTerms(MethodTerms):
    """A LoRA / QLoRA plan: the adapters' states as a small model of their own (`trained_shape`, in
    train.lora.dtype: `state_scale`), the frozen base beside them (memory.py), what the adapters save
    per block (`saved_bytes`), its host-to-device copies when offloaded (offload.py)."""

    freezes_base = True

    def __init__(self, adapters: Adapters) -> None:
        self.adapters = adapters

    def trains_under(self, sharding: Sharding) -> bool:
        return trains(self.adapters.method, sharding)

    def ranks_last(self, strategy: Strategy) -> bool:
        # offloaded adapter runs are verified on CPU only (offload.py)
        return strategy.offload_optimizer != "none" or strategy.offload_params != "none"

    def trained_shape(self, shape: ModelShape) -> ModelShape:
        return trainable_shape(shape, self.adapters)

    def state_scale(self, strategy: Strategy) -> dict[str, float]:
        return adapter_state_scale(strategy, self.adapters)

    def frozen_bytes(self, shape: ModelShape, hw: HardwareProfile, strategy: Strategy) -> PlacedBytes:
        return frozen_base_bytes(shape, strategy, shard_group_size(hw, strategy), self.adapters, compute_bytes(strategy))

    def saved_bytes(self, shape: ModelShape, c: int, sw: SoftwareStack) -> float:
        # a QLoRA base of older bitsandbytes keeps each 4-bit linear's input (software_terms.py)
        base_saves_input = self.adapters.quantized > 0 and software_terms.bnb_saves_4bit_input(sw)
        return adapter_saved_delta(shape, self.adapters, c, base_saves_input)

    def peak_bytes(self, shape: ModelShape, strategy: Strategy, seq_len: int,
                   activations_and_logits: float) -> dict[str, float]:
        return {"gathered_params": fsdp_forward_start_excess(shape, strategy, self.adapters, compute_bytes(strategy),
                                                             activations_and_logits)}

    def load_bytes(self, shape: ModelShape, hw: HardwareProfile, strategy: Strategy) -> float | None:
        c = compute_bytes(strategy)
        if self.adapters.quantized:
            return quantized_load_bytes(shape, hw.ranks_per_node, c, strategy, self.adapters)
        if strategy.backend == "ddp":
            return None  # loaded as full training loads it, then cast
        # A LoRA run's 16-bit base is read whole in the compute dtype and transformed (peft renames the keys
        # the sharded loaders fill): under FSDP2 by rank 0 alone, which broadcasts it into the shards; under
        # DeepSpeed by every rank (loading.py; QLoRA: memory.quantized_load_bytes).
        return (1 if strategy.backend == "fsdp" else hw.ranks_per_node) * c * shape.parameters

    def transfer_seconds(self, shape: ModelShape, hw: HardwareProfile, strategy: Strategy,
                         accumulation: int) -> float:
        if not hw.has_gpu:
            return 0.0
        return base_h2d_bytes(shape, strategy, shard_group_size(hw, strategy), self.adapters,
                              compute_bytes(strategy), accumulation) / hw.gpu.pcie_bandwidth

    def compute_seconds(self, shape: ModelShape, hw: HardwareProfile, strategy: Strategy,
                        accumulation: int) -> float:
        if not hw.has_gpu or not self.adapters.quantized:
            return 0.0
        return accumulation * quantized_linear_seconds(shape, strategy)


class Lora(Method):
    name = "lora"
    base = True
    runtime = "orchestrate.methods.lora.runtime"
    saves = (ADAPTER_DIR,)
    trains_adapters = True

    def active(self, config: RunConfig) -> bool:
        return config.train.method in ("lora", "qlora")

    def check(self, config: RunConfig, shape: ModelShape) -> None:
        adapters_for(config, shape)  # also for the other methods: train.lora set but unused is refused

    def terms(self, config: RunConfig, shape: ModelShape, auxiliary: dict[str, ModelShape]) -> MethodTerms:
        return AdapterTerms(adapters_for(config, shape))

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
