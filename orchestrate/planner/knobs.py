"""Memory knobs the planner can choose: chunked cross-entropy, activation offload, the 8-bit
optimizer and the input embedding in host memory. What each trades (memory terms and speed costs, each with its source), where each is
verified to run, and the options the search tries. Pure; memory.py, speed.py and search.py call it.

- Chunked cross-entropy (`loss_chunks`): the LM head + cross-entropy run on one chunk of the sequence
  at a time, each chunk recomputed in backward (worker/chunked_loss.py), so only one chunk's logits and
  their temporaries exist (the measured per-(token x vocab) logits constant applied to a chunk's rows),
  plus the gradient of the final hidden states, which the chunks fill in one by one. Cost: the LM head's
  forward runs twice (2·V·h FLOPs per token recomputed).
- Activation offload: with full recompute each block keeps only its input (Korthikanti et al. 2022,
  4.1); `torch.autograd.graph.save_on_cpu(pin_memory=True)` around the forward moves every tensor saved
  for backward (those inputs) to pinned host memory and brings each back when backward needs it. The
  device keeps the block being recomputed and the one copied back; the host holds all layers' inputs.
  Cost: each crosses PCIe twice (down in forward, up in backward), overlapped like other offload traffic.
- adamw8bit (bitsandbytes AdamW8bit, Dettmers et al. 2022 "8-bit Optimizers via Block-wise
  Quantization"): m and v in uint8 with one fp32 absmax per block of 256 (bitsandbytes/optim/optimizer.py,
  Optimizer8bit: block_wise, blocksize 256): 2 + 8/256 B/param instead of AdamW's 8.
- Embedding offload: a frozen input embedding (LoRA / QLoRA keep it in the compute dtype, unquantized:
  methods/lora/memory.py base_bytes) is only looked up, never multiplied, so it can stay in host memory: the
  lookup (a gather of b·s rows) runs on the CPU and only the rows (b x s x h, compute dtype) cross PCIe
  to the GPU, once per micro-batch (backends/ddp.py). Llama-3's 128,256 x 4096 table is 1 GiB of bf16.
  Not where it is tied to the LM head (the head multiplies the same tensor on the GPU), nor where it
  trains. Each DDP rank keeps its own host copy.
"""

from __future__ import annotations

import math

from orchestrate.backends.registry import knob_backends, runs_knob
from orchestrate.errors import Problem
from orchestrate.model.shape import ModelShape
from orchestrate.planner import constants as k
from orchestrate.planner.activations import checkpointed_bytes_per_token
from orchestrate.planner.strategy import Strategy

LOSS_CHUNK_TOKENS = 256
"""Sequence positions per chunk when the planner chooses chunking ("auto"): 256 x 128,256 vocab x 12 B
is 0.37 GiB of bf16 logits and temporaries, a sixteenth of the unchunked 5.9 GiB at seq 4096. The
recompute costs the same however many chunks (the LM head runs once more in all)."""

ADAMW8BIT_STATE_BYTES_PER_PARAM = 2 + 2 * 4 / 256
"""uint8 m and v + one fp32 absmax per 256 values of each (bitsandbytes blockwise 8-bit state)."""

ADAMW_STATE_BYTES_PER_PARAM = 8
"""fp32 m and v (the optimizer_states term of every backend)."""

ADAM8BIT_BYTES_PER_PARAM = k.ADAM_BYTES_PER_PARAM - 12
"""One 8-bit AdamW update reads and writes m and v as 1 byte each instead of 4: 16 + 12 + 2 B less 12."""

# Where each knob runs is each backend's `knobs` (backends/registry.py runs_knob): loss_chunks and activation_offload
# run under every backend (under ZeRO-3 the chunks run as one call of the LM head module, whose hooks gather it:
# worker/chunked_loss.py). adamw8bit: under FSDP2
# bitsandbytes gets DTensor parameters (fails: docs/measurements.md#backends); DeepSpeed builds its
# own optimizer from the rendered config, so a client bitsandbytes optimizer is not wired. embedding_offload:
# under FSDP2 and ZeRO-3 the embedding is a sharded parameter the engine gathers onto the GPU, under ZeRO-1/2 a
# parameter of the engine's flat groups; not built there (docs/memory-knobs.md).


def auto_loss_chunks(seq_len: int) -> int:
    return max(2, math.ceil(seq_len / LOSS_CHUNK_TOKENS))


def logits_rows(strategy: Strategy, seq_len: int, per_token: bool) -> int:
    """Rows of logits that exist at once: one chunk's positions when the loss is chunked."""
    if not per_token:
        return strategy.micro_batch_size
    if strategy.loss_chunks:
        return strategy.micro_batch_size * math.ceil(seq_len / strategy.loss_chunks)
    return strategy.micro_batch_size * seq_len


def hidden_gradient_bytes(shape: ModelShape, strategy: Strategy, seq_len: int, c: int) -> int:
    """Chunked loss only: the final hidden states' gradient, filled chunk by chunk (compute dtype)."""
    return strategy.micro_batch_size * seq_len * shape.hidden_size * c if strategy.loss_chunks else 0


def block_input_bytes(shape: ModelShape, strategy: Strategy, seq_len: int, c: int) -> float:
    """One checkpointed block's saved input (Korthikanti et al. 2022, 4.1), in the compute dtype."""
    return checkpointed_bytes_per_token(shape, c) * strategy.micro_batch_size * seq_len


def offloaded_activation_bytes(shape: ModelShape, strategy: Strategy, seq_len: int, c: int) -> float:
    """Host bytes of the offloaded block inputs (every layer's); 0 without activation offload. With the
    chunked loss also the LM head's weight: the model's own one-position projection (`logits_to_keep=1`,
    worker/chunked_loss.py) saves it, and save_on_cpu moves what is saved outside the recomputed blocks
    (its backward never runs, so it is not brought back; counted in the transfer both ways, on the safe side)."""
    if not strategy.activation_offload:
        return 0.0
    head = shape.logits_width * shape.hidden_size * c if strategy.loss_chunks else 0
    return shape.num_layers * block_input_bytes(shape, strategy, seq_len, c) + head


def optimizer_state_factor(strategy: Strategy) -> float:
    """The optimizer_states term relative to AdamW's fp32 m and v."""
    return ADAMW8BIT_STATE_BYTES_PER_PARAM / ADAMW_STATE_BYTES_PER_PARAM if strategy.optimizer == "adamw8bit" else 1.0


def recompute_flops_per_token(shape: ModelShape, strategy: Strategy) -> float:
    """Chunked loss: the LM head's forward again in backward (2 FLOPs per multiply-add)."""
    return 2 * shape.logits_width * shape.hidden_size if strategy.loss_chunks else 0.0


def offload_transfer_bytes(shape: ModelShape, strategy: Strategy, seq_len: int, c: int, accumulation: int) -> float:
    """PCIe bytes per step of activation offload: every block input down and back up, per micro-batch."""
    return 2 * accumulation * offloaded_activation_bytes(shape, strategy, seq_len, c)


def input_embedding_bytes(shape: ModelShape, c: int) -> int:
    """The input embedding table (vocab x hidden) in the compute dtype, as a frozen base stores it."""
    return shape.vocab_size * shape.hidden_size * c


def embedding_rows_bytes(shape: ModelShape, strategy: Strategy, seq_len: int, c: int) -> int:
    """One micro-batch's looked-up rows (b x s x h, compute dtype): what crosses PCIe per micro-batch."""
    return strategy.micro_batch_size * seq_len * shape.hidden_size * c


def host_embedding_bytes(shape: ModelShape, strategy: Strategy, seq_len: int, c: int) -> int:
    """Host bytes per rank of embedding offload: the table plus the lookup's output before its copy."""
    if not strategy.embedding_offload:
        return 0
    return input_embedding_bytes(shape, c) + embedding_rows_bytes(shape, strategy, seq_len, c)


def embedding_transfer_bytes(shape: ModelShape, strategy: Strategy, seq_len: int, c: int, accumulation: int) -> int:
    """PCIe bytes per step of embedding offload: the rows of every micro-batch, host to device. The token ids
    going down (8 B per token) are h·c/8 = 1024x less at h 4096 in bf16, left out."""
    return accumulation * embedding_rows_bytes(shape, strategy, seq_len, c) if strategy.embedding_offload else 0


def embedding_offload_problems(frozen: bool, tied: bool, has_gpu: bool) -> list[Problem]:
    """Why the input embedding cannot stay in host memory (empty when it can); the fixes name what works."""
    where, out = "train.embedding_offload", []
    if not frozen:
        out.append(Problem(where, "keeps a frozen input embedding in host memory; full fine-tuning trains it",
                           "set train.method: lora or qlora, or embedding_offload: false (or auto)"))
    if tied:
        out.append(Problem(where, "the input embedding is tied to the LM head, which needs it on the GPU",
                           "set embedding_offload: false (or auto)"))
    if not has_gpu:
        out.append(Problem(where, "moves the embedding off a GPU; this profile has none",
                           "set embedding_offload: false (or auto)"))
    return out


def knob_options(setting: object, backend: str, knob: str, usable: bool, choose: tuple) -> tuple:
    """What the search tries for one knob: the pin, or (auto) `choose` where the knob can run."""
    if setting != "auto":
        return (setting,)
    return choose if usable and runs_knob(backend, knob) else choose[:1]


def knob_problems(strategy: Strategy, has_gpu: bool, frozen_embedding: bool = False,
                  tied_embedding: bool = False) -> list[Problem]:
    """Why a strategy with these knobs cannot run (empty when it can); the fixes name what works.
    `frozen_embedding`: a LoRA / QLoRA run; `tied_embedding`: the shape's input embedding is the LM head."""
    # where the embedding cannot stay on the host under any backend, that alone is the reason
    out = embedding_offload_problems(frozen_embedding, tied_embedding, has_gpu) if strategy.embedding_offload else []
    backend_bound = strategy.embedding_offload and not out
    for knob, on in (("loss_chunks", strategy.loss_chunks > 0), ("activation_offload", strategy.activation_offload),
                     ("adamw8bit", strategy.optimizer == "adamw8bit"), ("embedding_offload", backend_bound)):
        if on and not runs_knob(strategy.backend, knob):
            where = "train.optimizer.name" if knob == "adamw8bit" else f"train.{knob}"
            out.append(Problem(where, f"{knob} is not verified to run under {strategy.backend}",
                               f"use backend {' or '.join(knob_backends(knob))}, or set it to auto"))
    if strategy.activation_offload and not has_gpu:
        out.append(Problem("train.activation_offload", "moves activations off a GPU; this profile has none",
                           "set activation_offload: false (or auto)"))
    if strategy.activation_offload and not strategy.activation_checkpointing:
        out.append(Problem("train.activation_offload", "offloads the inputs that activation checkpointing keeps",
                           "set train.activation_checkpointing: true (or auto)"))
    return out
