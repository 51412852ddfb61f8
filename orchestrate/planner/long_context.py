"""Long-context knobs the planner can choose: a tiled MLP, fused kernels and sequence parallelism. What
each changes in a rank's activations and step time, where each can run, and the options the search
tries. Pure; memory.py, speed.py and search.py call it. The three are the pieces of Arctic Long Sequence
Training (ALST, Bekman et al. 2025, arXiv 2506.13996) beside the checkpoint offload and chunked loss of
knobs.py:

- Tiled MLP (`mlp_tiles`): DeepSpeed's TiledMLP (deepspeed/runtime/sequence_parallel/ulysses_sp.py) runs
  each block's MLP over slices of the sequence without grad and saves only its input; backward recomputes
  one slice at a time. A block then keeps no intermediate-sized tensor per token (Llama-3-8B: 14,336 wide,
  3.5 x hidden, 4 of them in bf16 = 115 KB of the block's ~200 KB per token); the working set is one
  slice's (activations.tile_bytes). Cost: the MLP's forward once more per micro-batch.
- Fused kernels (`fused_kernels`): Liger-Kernel's RMSNorm and SwiGLU (Hsu et al. 2024, arXiv 2410.10989)
  save the norm's input and an fp32 rstd instead of an fp32 copy and a 16-bit normalised copy, and two of
  a gated MLP's three inputs to the product (activations.BlockCompute). Triton, so GPU only; families
  with a Liger patch only. Not priced as faster (conservative: the plan never relies on it).
- Sequence parallelism (`sequence_parallel`, DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509):
  the N ranks of a group hold 1/N of each sample's tokens; around attention an all-to-all trades the
  sequence split for a head split (q, k, v in, the output back), so every activation, the logits and the
  offloaded checkpoints per rank are those of seq_len / N tokens. Heads must divide by N (key/value
  heads too, or N by them: DeepSpeed's UlyssesSPAttentionHF then repeats them).
"""

from __future__ import annotations

import math

from orchestrate.backends.registry import priced_as, runs_knob
from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem
from orchestrate.model.shape import ModelShape
from orchestrate.planner import constants as k
from orchestrate.planner.activations import FAMILY_BLOCKS, BlockCompute
from orchestrate.planner.strategy import Strategy

MLP_TILE_TOKENS = 1024
"""Tokens per MLP slice when the planner tiles ("auto"): Llama-3-8B's slice working set is then
8 x 2 B x 14,336 x 1,024 = 224 MiB (activations.tile_bytes), and each slice is still a [1024 x 4096] x
[4096 x 14336] GEMM, large enough to run at full rate. ALST's recipe takes ceil(seq / hidden) slices
(4,096 tokens at hidden 4096), 0.9 GiB of working set: too much for an 8 GB card."""

FUSED_FAMILIES = frozenset({"llama", "mistral", "qwen2", "phi3", "gemma"})
"""Families Liger-Kernel patches (liger_kernel/transformers/monkey_patch.py apply_liger_kernel_to_*)."""


def block_compute(strategy: Strategy) -> BlockCompute:
    # the DDP engine tiles with a torch checkpoint per slice, the sharding engines with DeepSpeed's TiledMLP
    # (loading/tiled_mlp.py)
    checkpointed = priced_as(strategy.backend) == "ddp"
    return BlockCompute(fused=strategy.fused_kernels, mlp_tiles=strategy.mlp_tiles,
                        slice_gradients=k.CHECKPOINTED_SLICE_GRADIENTS if checkpointed else 2,
                        sequence_parallel=strategy.sequence_parallel)


def slice_length(seq_len: int, degree: int) -> int:
    """Tokens of each sample one rank holds when `degree` ranks split it."""
    return math.ceil(seq_len / degree)


def local_seq_len(strategy: Strategy, seq_len: int) -> int:
    """Tokens of each sample one rank holds (the whole sequence without sequence parallelism)."""
    return slice_length(seq_len, strategy.sequence_parallel)


def auto_mlp_tiles(tokens: int) -> int:
    """Slices auto tiles a micro-batch's `tokens` (per rank) into: one per MLP_TILE_TOKENS, 0 (untiled)
    where that is one slice."""
    tiles = math.ceil(tokens / MLP_TILE_TOKENS)
    return tiles if tiles > 1 else 0


def tiles_mlp(shape: ModelShape) -> bool:
    """Whether the family's blocks have an MLP the tiling wraps (the formula families but BERT)."""
    return shape.model_type in FAMILY_BLOCKS and shape.model_type != "bert" and shape.task == "causal-lm"


def fuses(shape: ModelShape) -> bool:
    return shape.model_type in FUSED_FAMILIES and shape.task == "causal-lm"


def heads_split(shape: ModelShape, degree: int) -> bool:
    """Whether Ulysses can split the attention heads over `degree` ranks."""
    kv = shape.num_kv_heads
    return shape.num_heads % degree == 0 and (kv % degree == 0 or degree % kv == 0)


def sequence_parallel_degrees(shape: ModelShape, world_size: int, seq_len: int) -> list[int]:
    """Degrees > 1 that can split this run: dividing the world, the heads and the sequence."""
    return [n for n in range(2, world_size + 1)
            if world_size % n == 0 and seq_len % n == 0 and heads_split(shape, n)]


def mlp_recompute_flops_per_token(shape: ModelShape, strategy: Strategy) -> float:
    """A tiled MLP runs its forward once more in backward: 2 FLOPs per MLP weight per token."""
    if not strategy.mlp_tiles:
        return 0.0
    gated = FAMILY_BLOCKS[shape.model_type].mlp_saved == 4 if shape.model_type in FAMILY_BLOCKS else False
    return 2 * (3 if gated else 2) * shape.hidden_size * shape.intermediate_size * shape.num_layers


def all_to_all_bytes(shape: ModelShape, strategy: Strategy, seq_len: int, c: int, passes: int) -> float:
    """Bytes one rank sends per micro-batch in Ulysses' all-to-alls: per block q, k, v out and the
    attention output back ((N-1)/N of the local rows leave the rank), in forward and the same in backward;
    `passes`: forward passes per micro-batch (2 with activation checkpointing: the recompute exchanges
    again)."""
    n = strategy.sequence_parallel
    if n == 1:
        return 0.0
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    per_token = c * (2 * q + 2 * kv)  # q, k, v in; the output out
    local = strategy.micro_batch_size * local_seq_len(strategy, seq_len)
    return (passes + 1) * shape.num_layers * per_token * local * (n - 1) / n


def long_context_note(strategy: Strategy, config: RunConfig) -> str | None:
    """What the plan chose of these knobs on "auto", and why (None where it chose none): the search tries them
    only where nothing fits without them and ranks by speed (search.py)."""
    train = config.train
    chosen = []
    if strategy.mlp_tiles and train.mlp_tiles == "auto":
        chosen.append(f"the MLP in {strategy.mlp_tiles} slices of the sequence (train.mlp_tiles)")
    if strategy.fused_kernels and train.fused_kernels == "auto":
        chosen.append("Liger-Kernel's fused RMSNorm and SwiGLU (train.fused_kernels)")
    if strategy.sequence_parallel > 1 and train.sequence_parallel == "auto":
        chosen.append(f"each sample's sequence split over {strategy.sequence_parallel} ranks (train.sequence_parallel)")
    if not chosen:
        return None
    return (f"long context: {'; '.join(chosen)}; no plan without {'it' if len(chosen) == 1 else 'them'} fits "
            "and is faster (docs/long-context.md)")


def long_context_problems(strategy: Strategy, shape: ModelShape, has_gpu: bool, fused_library: bool,
                          world_size: int, seq_len: int) -> list[Problem]:
    """Why a strategy with these knobs cannot run (empty when it can); the fixes name what works."""
    out = []
    if strategy.mlp_tiles and not tiles_mlp(shape):
        out.append(Problem("train.mlp_tiles", f"tiles the MLP of decoder blocks; {shape.model_type} "
                           f"({shape.task}) has none the planner knows", "set mlp_tiles: 0 (or auto)"))
    if strategy.fused_kernels:
        if not fuses(shape):
            out.append(Problem("train.fused_kernels", f"Liger-Kernel patches {', '.join(sorted(FUSED_FAMILIES))}; "
                               f"this model is {shape.model_type}", "set fused_kernels: false (or auto)"))
        if not has_gpu:
            out.append(Problem("train.fused_kernels", "Liger-Kernel's kernels are Triton, GPU only; this "
                               "profile has no GPU", "set fused_kernels: false (or auto)"))
        elif not fused_library:
            out.append(Problem("train.fused_kernels", "liger-kernel is not installed",
                               "pip install liger-kernel (or orchestrate[gpu]), or set fused_kernels: false"))
    n = strategy.sequence_parallel
    if n > 1:
        if world_size % n:
            out.append(Problem("train.sequence_parallel", f"{n} does not divide the world size {world_size}",
                               "use a divisor of the number of ranks, or auto"))
        if seq_len % n:
            out.append(Problem("train.sequence_parallel", f"{n} does not divide train.seq_len {seq_len}",
                               f"use a seq_len that is a multiple of {n}, or sequence_parallel: auto"))
        if not heads_split(shape, n):
            out.append(Problem("train.sequence_parallel", f"Ulysses splits the {shape.num_heads} attention heads "
                               f"({shape.num_kv_heads} key/value) over the ranks; {n} does not divide them",
                               "use a degree that divides the heads, or auto"))
    for knob, on in (("mlp_tiles", strategy.mlp_tiles > 0), ("fused_kernels", strategy.fused_kernels),
                     ("sequence_parallel", n > 1)):
        if on and not runs_knob(strategy.backend, knob):
            out.append(Problem(f"train.{knob}", f"{knob} is not verified to run under {strategy.backend}",
                               "use another backend, or set it to auto"))
    return out
