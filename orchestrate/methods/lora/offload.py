"""What offloading the frozen base to host memory adds to a LoRA / QLoRA run under DeepSpeed ZeRO-3
(`offload_param: {device: cpu}` with `offload_optimizer: {device: cpu}`; methods/lora/adapters.py
TRAINABLE_OFFLOADED), fsdp_qlora's layout for a base too large for the GPUs. Pure.

Memory (memory.frozen_base_bytes counts it): each rank keeps its partition of the base in host
memory, in the bytes it is stored in (NF4 codes packed into the compute dtype, `bnb_4bit_quant_storage`;
16-bit for lora), pinned when the rendered block says `pin_memory: true` (deepspeed_render.py; GPU
only): partition_parameters.py (Init: remote_device = offload_param.device; `_partition_param`) puts
`param.ds_tensor` there for every parameter, frozen ones included. On the GPU
ZeRO-3 holds what it gathers, the same term as without offload (memory.zero3_gathered_base):
a gathered parameter is a device tensor whichever device its partition lives on
(partitioned_param_coordinator.py fetch_sub_module).

Speed: the adapters are a small ZeRO-Offload model of their own (speed._offload on
memory.trainable_shape: their gradients down, CPU Adam, their updated values up); the base adds
its partition's host-to-device copy before each forward and each backward all-gather of every
micro-batch (backward gathers it again for the input gradients), as full training's ZeRO-3 parameter
offload term does (speed._offload), but nothing comes back down: it has no gradient and no update.

Ranking: verified on CPU only (docs/measurements.md#methodsloraadapterspy), so the search takes an
offloaded adapter run only where nothing without offload fits (method.py `adapter_terms`:
`offloaded_last`), as it does for activation offload.
"""

from __future__ import annotations

from orchestrate.methods.lora.adapters import Adapters
from orchestrate.methods.lora.memory import base_bytes
from orchestrate.model.shape import ModelShape
from orchestrate.planner.strategy import Strategy


def base_h2d_bytes(shape: ModelShape, strategy: Strategy, n: int, adapters: Adapters, c: int,
                   accumulation: int) -> float:
    """Bytes of one rank's frozen-base partition copied to the device per optimizer step (0 unless the
    base's partitions are offloaded to CPU under ZeRO-3)."""
    if strategy.backend != "deepspeed" or strategy.zero_stage != 3 or strategy.offload_params == "none":
        return 0.0
    whole, _, _ = base_bytes(shape, adapters, c)
    return accumulation * 2 * whole / n

