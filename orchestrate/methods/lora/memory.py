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
- Adapters in bf16 (`train.lora.dtype`): 2 + 2 + 4 B/param under DDP and FSDP2 (torch's AdamW keeps
  its states in the parameter's dtype); DeepSpeed keeps its fp32 master and states either way.
- Activations and logits are the full-training terms with what the adapters change in each block
  (`adapter_saved_delta`): a frozen linear saves no input (autograd saves `mat1` of addmm only when the
  weight needs a gradient: tools/autograd/derivatives.yaml + the saved-variable codegen), the adapter's
  lora_A saves its input, and that input is a dropped copy per adapter when lora_dropout > 0 (peft
  tuners/lora/layer.py Linear.forward: `lora_B(lora_A(dropout(x)))`); older bitsandbytes kept each
  4-bit linear's input too (software_terms.bnb_saves_4bit_input). x·A (r wide) stays below resolution.

Pure arithmetic; the method's terms (method.py) call it.
"""

from __future__ import annotations

from dataclasses import replace

from orchestrate.backends.registry import shards_parameters
from orchestrate.methods.lora.adapters import Adapters
from orchestrate.model.shape import ModelShape
from orchestrate.planner import constants as k
from orchestrate.planner import ds_buckets
from orchestrate.planner.strategy import Strategy
from orchestrate.planner.terms import PlacedBytes


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


def fsdp_forward_start_bytes(shape: ModelShape, strategy: Strategy, adapters: Adapters, c: int) -> dict[str, float]:
    """What the forward start of a frozen base under FSDP2 full shard holds before any activation exists:
    each all-gather's output is copied into the unsharded parameters (_fsdp_collectives.py
    foreach_all_gather_copy_out), so the root and the prefetched first block exist twice. The memory model
    adds what exceeds the backward-start peak's activations and logits: the peak is the larger of the two
    (simulated: llama widths at 512 tokens peak there)."""
    if strategy.backend != "fsdp" or strategy.zero_stage != 3:
        return {}
    _, block, root = base_bytes(shape, adapters, c)
    return {"gathered_params": root + block}


def zero3_gathered_base(shape: ModelShape, whole: float, c: int) -> float:
    """Base bytes ZeRO-3 holds gathered at the end of forward: as for full training (memory._deepspeed),
    the module running, the LM head (usually the largest layer), or the up to stage3_max_live_parameters
    the prefetcher gathers ahead (planner/ds_buckets.py); every block is released after its forward.
    Frozen or not makes no difference to the coordinator: with adapters too, the simulation holds the
    head alone at the end of forward (docs/measurements.md#methodsloramemorypy)."""
    return min(whole, c * max(shape.largest_layer_parameters, ds_buckets.stage3_max_live(shape)))


def quantized_load_bytes(shape: ModelShape, ranks_per_node: int, c: int, strategy: Strategy,
                         adapters: Adapters) -> float:
    """Host bytes of a node while QLoRA's base loads, quantized tensor by tensor as it arrives
    (methods/lora/quantized_loading.py): each rank holds one tensor as read (at most fp32) plus its cast to the
    compute dtype; the largest tensor is the embedding or LM head (vocab x hidden) or the largest layer.
    DDP fills its device, so that is all; FSDP2 and DeepSpeed load on the CPU and shard or move the model
    afterwards, so each rank also holds its whole quantized base there (`base_bytes`: NF4 block linears,
    the rest in the compute dtype), never the 16-bit one (checked against live tensors at the peak:
    docs/measurements.md#methodsloramemorypy)."""
    largest = max(shape.largest_layer_parameters, shape.vocab_size * shape.hidden_size)
    held = 0.0 if strategy.backend == "ddp" else base_bytes(shape, adapters, c)[0]
    return ranks_per_node * ((k.LOAD_BYTES_PER_PARAM + c) * largest + held)


# Which saved tensor of the activation formula (planner/activations.py) each block linear reads: the
# attention input (the norm's output), the MLP input, the down projection's input (an MLP intermediate);
# o_proj reads the attention output, which the attention kernel saves anyway.
_INPUT_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "qkv_proj": "attn", "c_attn": "attn",
             "gate_proj": "mlp", "up_proj": "mlp", "gate_up_proj": "mlp", "c_fc": "mlp", "down_proj": "down"}


def adapter_saved_delta(shape: ModelShape, adapters: Adapters, c: int, base_saves_input: bool) -> float:
    """Bytes per token and block that a LoRA / QLoRA block saves beyond the full-training formula, which
    counts each linear input once (c·h for the attention and MLP inputs, c·I for the down projection's).
    Per input: kept once if the frozen base keeps it (`base_saves_input`: a QLoRA base of older
    bitsandbytes) or an adapter reads it undropped; with lora_dropout > 0 each adapter on it keeps its
    own dropped copy (c bytes) and 1-byte mask (torch native_dropout). o_proj's dropped copy is extra.
    Names outside `_INPUT_OF` (GPT-2's two c_proj) keep the formula's count."""
    if shape.model_type == "gpt2":
        return 0.0  # c_proj names both projections: which one is adapted is not known from the name
    width = {"attn": shape.hidden_size, "mlp": shape.hidden_size, "down": shape.intermediate_size}
    readers = {group: [n for n in adapters.adapted if _INPUT_OF.get(n) == group] for group in width}
    delta = 0.0
    for group, d in width.items():
        if adapters.dropout > 0:
            kept = (c * d if base_saves_input else 0) + len(readers[group]) * (c + 1) * d
        else:
            kept = c * d if (base_saves_input or readers[group]) else 0
        delta += kept - c * d
    if adapters.dropout > 0 and "o_proj" in adapters.adapted:
        delta += (c + 1) * shape.num_heads * shape.head_dim
    return delta


def adapter_state_scale(strategy: Strategy, adapters: Adapters) -> dict[str, float]:
    """bf16 adapters (train.lora.dtype) under DDP and FSDP2: weights, gradients, Adam states and DDP's
    gradient buckets at 2/4 of the fp32 terms, and no autocast copy of them for the matmuls (already
    the compute dtype). DeepSpeed's bf16 optimizer keeps fp32 masters and states (unchanged).
    Factors by breakdown key, for the memory model to apply to the adapters' states."""
    if adapters.dtype_bytes == 4 or strategy.backend == "deepspeed":
        return {}
    ratio = adapters.dtype_bytes / 4
    keys = ("weights", "gradients", "optimizer_states", "master_weights",
            "offloaded_params", "offloaded_gradients", "offloaded_optimizer")
    scale = dict.fromkeys(keys, ratio)
    if strategy.backend == "ddp":
        scale |= {"comm_buckets": ratio, "gathered_params": 0.0}
    return scale
