"""Memory of a LoRA / QLoRA run's model states: the adapters train like a small model of their own,
the base is frozen (no gradients, no optimizer states; peft sets requires_grad=False on it).

- Adapters: r·(d_in + d_out) per adapted linear (`Adapters.trainable`), fp32 weights, gradients and
  Adam m, v: the backend's own full-training terms applied to a model of that many parameters
  (`trainable_shape`), so DDP's replicated 16 B/param and FSDP2's sharded 16/n B/param hold as for
  full training.
- Frozen base: the compute dtype (the LoRA transform casts it there; fp32 on CPU), or NF4 for its
  block linears under QLoRA (`adapters.nf4_bits_per_param`: 4.127 bits with double quantization,
  Dettmers et al. 2023) with everything else (embeddings, norms, LM head) in the compute dtype.
  Replicated under DDP, sharded over n ranks under FSDP2 (fully_shard shards frozen parameters too).
- Activations and logits are the full-training terms: the input gradients of every frozen linear
  need the same saved inputs (LoRA's own saved tensors, the dropout output and x·A of width r, are
  below the measurement's resolution for r << hidden).

Pure arithmetic; the method's terms (method.py) call it.
"""

from __future__ import annotations

from dataclasses import replace

from orchestrate.backends.registry import shards_parameters
from orchestrate.methods.lora.adapters import Adapters
from orchestrate.methods.spec import PlacedBytes
from orchestrate.model.shape import ModelShape
from orchestrate.planner import constants as k
from orchestrate.planner import ds_buckets
from orchestrate.planner.strategy import Strategy


def trainable_shape(shape: ModelShape, adapters: Adapters) -> ModelShape:
    """The adapters seen as a model: one block of adapters per transformer block, no embeddings."""
    return replace(shape, parameters=adapters.trainable, largest_layer_parameters=adapters.block_trainable,
                   embedding_parameters=0, lm_head_parameters=0, block_parameters=adapters.block_trainable,
                   tied_embeddings=False)


def base_bytes(shape: ModelShape, adapters: Adapters, c: int) -> tuple[float, float, float]:
    """(whole base, one block, the root: embeddings + final norm + LM head) in bytes as stored."""
    bits = adapters.base_bits_quantized
    whole = (shape.parameters - adapters.quantized) * c + adapters.quantized * bits / 8
    block = (shape.block_parameters - adapters.block_quantized) * c + adapters.block_quantized * bits / 8
    return whole, block, shape.root_parameters * c


def frozen_base_bytes(shape: ModelShape, strategy: Strategy, n: int, adapters: Adapters, c: int) -> PlacedBytes:
    """The frozen base's bytes beside a placement of the adapters' states (per rank)."""
    out = PlacedBytes()
    whole, block, root = base_bytes(shape, adapters, c)
    sharded = shards_parameters(strategy.sharding)
    per_rank = whole / n if sharded else whole
    if sharded and strategy.offload_params != "none":  # ZeRO-3 offload_param: on the host (offload.py)
        out.on_cpu("offloaded_params", per_rank)
    else:
        out.on_gpu("weights", per_rank)
    if strategy.backend == "fsdp":
        # The root stays unsharded (memory._fsdp). With a frozen base the peak is where backward starts,
        # not in it (the adapters' gradients are small): the blocks resharded after forward, the last one's
        # all-gather for backward in flight: root + one block (simulated). Shard-grad-op keeps them all.
        out.on_gpu("gathered_params", (root + block) if strategy.zero_stage == 3 else whole)
    elif sharded:
        out.on_gpu("gathered_params", zero3_gathered_base(shape, whole, c))
    if adapters.quantized:
        # bitsandbytes dequantizes a 4-bit weight to the compute dtype for each matmul (forward, and
        # again for the input gradient): one block linear's weights at a time (bnb/autograd/_functions.py
        # MatMul4Bit).
        out.on_gpu("gathered_params", c * adapters.largest_linear)
    return out


def fsdp_forward_start_excess(shape: ModelShape, strategy: Strategy, adapters: Adapters, c: int,
                              activations_and_logits: float) -> float:
    """What the forward start of a frozen base under FSDP2 full shard holds beyond the backward-start
    peak counted above: each all-gather's output is copied into the unsharded parameters
    (_fsdp_collectives.py foreach_all_gather_copy_out), so the root and the prefetched first block exist
    twice before any activation does. The peak is the larger of the two (simulated: llama widths at
    512 tokens peak there)."""
    if strategy.backend != "fsdp" or strategy.zero_stage != 3:
        return 0.0
    _, block, root = base_bytes(shape, adapters, c)
    return max(0.0, root + block - activations_and_logits)


def zero3_gathered_base(shape: ModelShape, whole: float, c: int) -> float:
    """Base bytes ZeRO-3 holds gathered at the end of forward: as for full training (memory._deepspeed),
    the module running, the LM head (usually the largest layer), or the up to stage3_max_live_parameters
    the prefetcher gathers ahead (planner/ds_buckets.py); every block is released after its forward.
    Frozen or not makes no difference to the coordinator. Simulated (bench/memory_accuracy.py --lora):
    llama, gpt2 (tied) hold their head alone at the end of forward, with and without checkpointing."""
    return min(whole, c * max(shape.largest_layer_parameters, ds_buckets.stage3_max_live(shape)))


def quantized_load_bytes(shape: ModelShape, ranks_per_node: int, c: int, strategy: Strategy,
                         adapters: Adapters) -> float:
    """Host bytes of a node while QLoRA's base loads, quantized tensor by tensor as it arrives
    (methods/lora/quantized_loading.py): each rank holds one tensor as read (at most fp32) plus its cast to the
    compute dtype; the largest tensor is the embedding or LM head (vocab x hidden) or the largest layer.
    DDP fills its device, so that is all; FSDP2 and DeepSpeed load on the CPU and shard or move the model
    afterwards, so each rank also holds its whole quantized base there (`base_bytes`: NF4 block linears,
    the rest in the compute dtype), never the 16-bit one. Measured on CPU (live tensors at the peak,
    tests/test_quantized_loading.py, test_quantized_loading_sharded.py): 41-47 MiB for a 51.7M-parameter
    model onto DDP's device vs 203 MiB loading it in fp32; on the CPU for an FSDP2 plan 41 MiB (26 of them the
    NF4 model) against this term's 48 MiB (fp32 compute dtype)."""
    largest = max(shape.largest_layer_parameters, shape.vocab_size * shape.hidden_size)
    held = 0.0 if strategy.backend == "ddp" else base_bytes(shape, adapters, c)[0]
    return ranks_per_node * ((k.LOAD_BYTES_PER_PARAM + c) * largest + held)
