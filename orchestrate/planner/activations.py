"""Saved activations per transformer block, derived from each family's block structure.

Pure arithmetic on a `ModelShape` (no torch). The base is Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", section 4): count, per token, the bytes of every tensor
autograd saves for backward. Their 34·s·b·h + 5·a·s²·b assumes Megatron's fused blocks; HF blocks save
more (fp32 norm statistics, python-level activations, dropout masks), so each term below follows the
transformers modeling code of the family (transformers 5, `models/<family>/modeling_<family>.py`) and
torch's autograd formulas (`tools/autograd/derivatives.yaml`: what each op saves):

- Linear / Conv1D (addmm) saves its input; several projections of one input share it.
- SDPA (flash / memory-efficient kernels, CUDA and CPU) saves q, k, v, its output and a logsumexp
  of 4 bytes per head and token; no s² matrix (the "5·a·s/h" term of Korthikanti disappears). With
  GQA transformers passes `enable_gqa=True` (integrations/sdpa_attention.py `use_gqa_in_sdpa`), so
  k and v are kv-head sized. The output's transpose + reshape is a view of the kernel's (b, s, a, d)
  result, so o_proj saves that same storage.
- RoPE (`apply_rotary_pos_emb`): q·cos + rotate_half(q)·sin saves only cos/sin (shared by all
  layers) and yields new q, k tensors; the raw projections are freed.
- LayerNorm (native_layer_norm) saves its input and fp32 mean + rstd per token.
- Llama-style RMSNorm upcasts: the fp32 copy (4 B) is saved by pow and mul, the 16-bit normalised
  value by the weight multiply, plus an fp32 rsqrt per token; under fp32 compute the two are 4 B each.
- Dropout (CUDA `native_dropout`) saves a 1-byte mask; attention dropout lives inside the SDPA kernel.
- MLP activations: GPT-2's `gelu_new` is python (activations.py NewGELUActivation) and keeps x,
  tanh(.), 0.5·x and 1+tanh(.) besides the output; SwiGLU (SiLU(gate)·up) keeps gate, SiLU(gate),
  up and the product; a single-op GELU keeps its input and output.

Checked against fake-tensor simulations of the real models (`orchestrate.simulate.activation_fit`, per-
layer bytes from 1- and 2-layer builds, bf16): GPT-2 58.07·s·b·h per layer (this formula: 58.08),
TinyLlama widths 42.57 (42.57). See docs/memory-model.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrate.model.shape import ModelShape

FP32 = 4
MASK = 1  # torch.native_dropout's bool mask (aten/src/ATen/native/cuda/Dropout.cu)
LSE = 4  # fp32 logsumexp per head and token saved by the flash / efficient SDPA kernels


@dataclass(frozen=True)
class BlockStructure:
    """What in a family's block decides its saved activations."""

    norm: str
    """"layernorm", "rmsnorm" (Llama: fp32 upcast, 16-bit result) or "rmsnorm_fp32" (Gemma: result
    kept fp32 until after the weight multiply, modeling_gemma.py GemmaRMSNorm)."""
    fused_qkv: bool
    """One projection for q, k and v (GPT-2 c_attn, Phi-3 qkv_proj): the slices are views, so the
    whole q+k+v storage stays alive while SDPA (or v alone) holds a view of it."""
    rope: bool
    mlp_saved: int
    """Intermediate-sized tensors the MLP saves (see module doc): 5 for gelu_new, 4 for gated MLPs."""
    post_norm: bool = False
    """BERT: LayerNorm after each residual add (its output is the next sub-block's input too)."""
    dropout_masks: int = 0
    """Dropout masks per block at the family's default probabilities (GPT-2: attention output and
    MLP output, resid_pdrop 0.1; the Llama-style families default to 0)."""
    embedding_dropout: bool = False


_LLAMA = BlockStructure(norm="rmsnorm", fused_qkv=False, rope=True, mlp_saved=4)
FAMILY_BLOCKS: dict[str, BlockStructure] = {
    # modeling_gpt2.py GPT2Block: ln_1, c_attn, sdpa, c_proj, resid dropout, ln_2, c_fc, gelu_new,
    # c_proj, dropout; GPT2Model applies drop(wte + wpe).
    "gpt2": BlockStructure(norm="layernorm", fused_qkv=True, rope=False, mlp_saved=5, dropout_masks=2,
                           embedding_dropout=True),
    # modeling_llama.py / modeling_mistral.py / modeling_qwen2.py: the same decoder layer (Qwen2's q/k/v
    # biases add no saved tensor); attention_dropout defaults to 0.
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    # modeling_phi3.py: fused qkv_proj and gate_up_proj (chunk views: SiLU keeps the whole 2I storage,
    # i.e. the same 4 intermediate-sized tensors as gate + up); resid/embd dropout default 0.
    "phi3": BlockStructure(norm="rmsnorm", fused_qkv=True, rope=True, mlp_saved=4),
    # modeling_gemma.py: GemmaRMSNorm keeps fp32 x and fp32 normalised x; GeGLU with gelu_pytorch_tanh.
    "gemma": BlockStructure(norm="rmsnorm_fp32", fused_qkv=False, rope=True, mlp_saved=4),
    # modeling_bert.py BertLayer: q/k/v Linear, sdpa, dense + dropout + LayerNorm(x + input),
    # intermediate dense + GELU (erf, one op: input and output), output dense + dropout + LayerNorm;
    # hidden_dropout_prob 0.1; embeddings LayerNorm + dropout.
    "bert": BlockStructure(norm="layernorm", fused_qkv=False, rope=False, mlp_saved=2, post_norm=True,
                           dropout_masks=2, embedding_dropout=True),
}

FALLBACK_BYTES_PER_TOKEN_HIDDEN_16BIT = 62
"""Unknown families: the GPT-2 figure this module replaced (the highest per-hidden figure of
the families above), as a conservative default."""


@dataclass(frozen=True)
class BlockCompute:
    """How the blocks compute, where that changes what they keep for backward (planner/long_context.py)."""

    fused: bool = False
    """Liger-Kernel's RMSNorm and SwiGLU (liger_kernel/ops/rms_norm.py LigerRMSNormFunction saves its input
    X and an fp32 RSTD per row; ops/swiglu.py LigerSiLUMulFunction saves a and b and recomputes SiLU in
    backward): each norm keeps c·h + 4 per token, a gated MLP 3 intermediate-sized tensors (gate, up and
    the product down_proj saves) instead of 4."""
    mlp_tiles: int = 0
    """The MLP runs as DeepSpeed's TiledMLP (deepspeed/runtime/sequence_parallel/ulysses_sp.py): forward
    over `mlp_tiles` slices under no_grad, saving only the MLP's input; backward recomputes one slice at a
    time with grad and accumulates the input gradient into one full-size buffer (`x_grad`). 0: one pass."""
    slice_gradients: int = 2
    """Hidden-sized tensors per token a tiled MLP's backward holds beside one slice's working set: 2 for
    DeepSpeed's TiledMLP (its full-size `x_grad` and the incoming gradient), more where the slices are
    torch checkpoints (planner/constants.py CHECKPOINTED_SLICE_GRADIENTS)."""
    sequence_parallel: int = 1
    """Ulysses: attention's backward exchanges the q, k, v gradients back over all-to-all, so a second copy
    of them exists while it runs (deepspeed/runtime/sequence_parallel/ulysses_sp.py _SeqAllToAll)."""


PLAIN = BlockCompute()


def norm_bytes(norm: str, hidden: int, c: int, fused: bool = False) -> int:
    """Bytes per token one norm saves; `fused`: Liger's RMSNorm (the input and an fp32 rstd)."""
    if fused and norm != "layernorm":
        return c * hidden + FP32
    if norm == "layernorm":
        return c * hidden + 2 * FP32  # input + fp32 mean, rstd
    if norm == "rmsnorm":
        return (FP32 + c) * hidden + FP32  # fp32 copy + 16-bit normalised + fp32 rsqrt
    return 2 * FP32 * hidden + FP32  # rmsnorm_fp32: fp32 copy + fp32 normalised + rsqrt


@dataclass(frozen=True)
class EagerAttention:
    """The attention of transformers releases before SDPA was a family's default (software_terms.py):
    matmul, softmax, dropout and matmul as separate ops, so autograd keeps s x s tensors per head."""

    seq_len: int
    softmax_bytes: int
    """4 where the softmax runs in fp32 (Llama's eager attention up-casts; autocast runs softmax in
    fp32), else the compute dtype's c."""
    dropout: bool
    """Attention dropout on (0.1 by default in BERT and GPT-2: software_terms.eager_attention_dropout)."""


def eager_attention_bytes(attn: EagerAttention, heads: int, c: int) -> int:
    """Per token: the softmax output (saved by softmax backward), with dropout its 1-byte mask and the
    c-byte dropped probabilities the value matmul saves, else the c-byte copy that matmul saves when the
    softmax ran in fp32 (torch derivatives.yaml: _softmax saves its result, native_dropout its mask, bmm
    its operands). modeling_bert.py BertSelfAttention / modeling_llama.py LlamaAttention (eager)."""
    probs = (MASK + c) if attn.dropout else (c if attn.softmax_bytes != c else 0)
    return heads * attn.seq_len * (attn.softmax_bytes + probs)


def mlp_saved(shape: ModelShape, compute: BlockCompute = PLAIN) -> int:
    """Intermediate-sized tensors the MLP saves (fused: Liger's SwiGLU keeps one fewer)."""
    block = FAMILY_BLOCKS[shape.model_type]
    return block.mlp_saved - 1 if compute.fused and block.mlp_saved == 4 else block.mlp_saved


def layer_bytes_per_token(shape: ModelShape, c: int, eager: EagerAttention | None = None,
                          compute: BlockCompute = PLAIN) -> float:
    """Bytes one block saves for backward per token, compute dtype of c bytes (no recomputation);
    `eager`: the scores are materialised (no SDPA logsumexp then); `compute`: fused kernels, a tiled MLP
    (which keeps only its input: the slices' intermediates are `tile_bytes`)."""
    block = FAMILY_BLOCKS.get(shape.model_type)
    h = shape.hidden_size
    if block is None:
        return FALLBACK_BYTES_PER_TOKEN_HIDDEN_16BIT * h * c / 2
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    norms = 2 * norm_bytes(block.norm, h, c, compute.fused)
    attn_in = c * h  # shared input of the q/k/v projections
    if block.fused_qkv:
        qkv = c * (q + 2 * kv) + (c * (q + kv) if block.rope else 0)  # whole storage + rotated q, k
    else:
        qkv = c * (q + 2 * kv)  # q, k (rotated or not: one tensor each) and v
    scores = eager_attention_bytes(eager, shape.num_heads, c) if eager else LSE * shape.num_heads
    attn = attn_in + qkv + c * q + scores  # + the attention output (= o_proj input)
    mlp = c * h + (0 if compute.mlp_tiles else mlp_saved(shape, compute) * c * shape.intermediate_size)
    return norms + attn + mlp + MASK * h * block.dropout_masks


def outside_bytes_per_token(shape: ModelShape, c: int, compute: BlockCompute = PLAIN) -> float:
    """Saved per token outside the blocks: embedding dropout mask, the final norm (pre-norm families)
    and the LM head's input (checked against the simulation: docs/measurements.md#planneractivationspy)."""
    block = FAMILY_BLOCKS.get(shape.model_type)
    h = shape.hidden_size
    if block is None:
        return 0
    final_norm = 0 if block.post_norm else norm_bytes(block.norm, h, c, compute.fused)
    return MASK * h * block.embedding_dropout + final_norm + c * h


MLP_BACKWARD_GRADIENTS = 4
"""Intermediate-sized gradients alive at once in an MLP's backward (the output projection's input
gradient, then each factor's and the activation's): the simulated count for GPT-2's gelu_new and Llama's
SwiGLU, rounded up (docs/measurements.md#planneractivationspy)."""


def backward_transient_bytes_per_token(shape: ModelShape, c: int) -> float:
    """Gradients a block's backward holds beside what it saved: the gradient of the block's output
    (c·h) and its MLP's intermediate-sized gradients."""
    return c * shape.hidden_size + MLP_BACKWARD_GRADIENTS * c * shape.intermediate_size


def tile_bytes(shape: ModelShape, c: int, tokens: int, compute: BlockCompute) -> float:
    """A tiled MLP's backward working set: one slice's recomputed intermediates and their gradients
    (TiledMLP.backward runs forward and backward of one `ceil(tokens / tiles)`-token slice at a time)."""
    if shape.model_type not in FAMILY_BLOCKS:
        return 0.0
    slice_tokens = -(-tokens // compute.mlp_tiles)
    return (mlp_saved(shape, compute) + MLP_BACKWARD_GRADIENTS) * c * shape.intermediate_size * slice_tokens


def attention_gradient_bytes_per_token(shape: ModelShape, c: int, compute: BlockCompute = PLAIN) -> float:
    """What a block's attention backward holds beside what it saved: the block output's gradient, the
    attention output's and the q, k, v gradients (with sequence parallelism twice: before and after the
    exchange). Below the MLP's (`backward_transient_bytes_per_token`) unless the MLP is tiled."""
    q = shape.num_heads * shape.head_dim
    qkv = c * (q + 2 * shape.num_kv_heads * shape.head_dim)
    return c * shape.hidden_size + c * q + (2 if compute.sequence_parallel > 1 else 1) * qkv


def backward_transient_bytes(shape: ModelShape, c: int, tokens: int, compute: BlockCompute = PLAIN) -> float:
    """Gradients a block's backward holds beside what it saved, for a micro-batch of `tokens`: the larger of
    its MLP's phase (`backward_transient_bytes_per_token`; a tiled MLP instead its full-size input gradients,
    `slice_gradients` x c·h per token, and one slice's working set, `tile_bytes`) and its attention's phase."""
    if shape.model_type not in FAMILY_BLOCKS:
        return backward_transient_bytes_per_token(shape, c) * tokens
    mlp = (compute.slice_gradients * c * shape.hidden_size * tokens + tile_bytes(shape, c, tokens, compute)
           if compute.mlp_tiles
           else backward_transient_bytes_per_token(shape, c) * tokens)
    return max(mlp, attention_gradient_bytes_per_token(shape, c, compute) * tokens)


def last_block_bytes(shape: ModelShape, c: int, tokens: int, eager: EagerAttention | None = None,
                     layer_delta_per_token: float = 0.0, compute: BlockCompute = PLAIN) -> int:
    """What the first block's backward (the last of the pass) holds while nearly every gradient
    exists: its saved (or, checkpointed, recomputed) activations and its backward's gradients."""
    layer = layer_bytes_per_token(shape, c, eager, compute) + layer_delta_per_token
    return int(layer * tokens + backward_transient_bytes(shape, c, tokens, compute))


def checkpointed_bytes_per_token(shape: ModelShape, c: int) -> float:
    """Full activation checkpointing keeps each block's input, c·h per token (Korthikanti et al. 2022,
    section 4.1; transformers GradientCheckpointingLayer checkpoints the whole block)."""
    return c * shape.hidden_size


def activation_bytes(shape: ModelShape, c: int, tokens: int, checkpointing: bool, logits: int,
                     stored_layers: int | None = None, eager: EagerAttention | None = None,
                     layer_delta_per_token: float = 0.0, compute: BlockCompute = PLAIN) -> int:
    """Saved activations of a micro-batch of `tokens` tokens at the backward-start peak;
    `stored_layers`: how many checkpointed block inputs are on the device (all, unless offloaded);
    `layer_delta_per_token`: what adapters change in each block (adapter_memory.adapter_saved_delta);
    `compute`: fused kernels, a tiled MLP (BlockCompute).

    The last block's backward runs only after the LM head and loss have been differentiated and their
    `logits` bytes freed, so what it adds (its gradients; with checkpointing, also the block's
    recomputed activations) raises the peak only by what it exceeds them."""
    outside = outside_bytes_per_token(shape, c, compute) * tokens
    layer = (layer_bytes_per_token(shape, c, eager, compute) + layer_delta_per_token) * tokens
    transient = backward_transient_bytes(shape, c, tokens, compute)
    if not checkpointing:
        return int(outside + shape.num_layers * layer + max(0.0, transient - logits))
    stored = (shape.num_layers if stored_layers is None else stored_layers) * checkpointed_bytes_per_token(shape, c) * tokens
    return int(outside + stored + max(0.0, layer + transient - logits))
