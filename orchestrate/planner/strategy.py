"""A candidate training strategy: one point of the planner's search space.

Names are stable strings users see in tables and pass back as pins, e.g.
`deepspeed-z3-offload_opt_cpu-offload_param_cpu-bf16-ac-mb2`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Offload = Literal["none", "cpu", "nvme"]
Precision = Literal["bf16", "fp16", "fp32"]


@dataclass(frozen=True)
class Sharding:
    """Where a strategy keeps the model states: a Strategy without precision, activation
    checkpointing and micro-batch. What backends judge (`Backend.problems`)."""

    backend: str
    zero_stage: int
    offload_optimizer: Offload = "none"
    offload_params: Offload = "none"
    hybrid_shard: bool = False


@dataclass(frozen=True)
class Strategy:
    backend: str
    """A registered backend: ddp = torch DistributedDataParallel; deepspeed = ZeRO engine; fsdp = FSDP2
    `fully_shard` (orchestrate/backends/registry.py)."""
    zero_stage: int
    """0 = replicate everything (DDP); 1 = shard optimizer states; 2 = + gradients; 3 = + parameters.
    For fsdp: 3 = full shard (`reshard_after_forward=True`), 2 = shard-grad-op (`False`)."""
    offload_optimizer: Offload
    """Where optimizer states (and the fp32 master copy) live when not on the GPU."""
    offload_params: Offload
    """Where parameters live between uses (ZeRO-3 / FSDP full shard only)."""
    precision: Precision
    activation_checkpointing: bool
    micro_batch_size: int
    hybrid_shard: bool = False
    """FSDP2 only: shard inside a node, replicate across nodes (2-D device mesh)."""
    loss_chunks: int = 0
    """Chunks over the sequence the LM head + cross-entropy run in, each recomputed in backward (0: one
    pass, the full logits exist). planner/knobs.py."""
    activation_offload: bool = False
    """Checkpointed blocks' inputs kept in pinned CPU memory until backward (torch save_on_cpu)."""
    optimizer: str = "adamw"
    """adamw (fp32 states) or adamw8bit (bitsandbytes AdamW8bit, block-wise 8-bit states)."""
    embedding_offload: bool = False
    """A frozen, untied input embedding kept in host memory: its lookup runs there, the rows go to the GPU
    (planner/knobs.py)."""
    mlp_tiles: int = 0
    """Each block's MLP computed over this many slices of the sequence, each recomputed in backward, so only
    one slice's intermediate-sized tensors exist (DeepSpeed's TiledMLP, ALST); 0: one pass (planner/long_context.py)."""
    sequence_parallel: int = 1
    """Ranks each sample's sequence is split over (Ulysses: attention all-to-all over heads); the data-parallel
    degree is the world size over this (planner/long_context.py)."""
    fused_kernels: bool = False
    """Liger-Kernel's fused RMSNorm, RoPE and SwiGLU in place of the family's eager ones (GPU, Triton)."""

    @property
    def family(self) -> str:
        """The backend and ZeRO stage ("ddp-z0", "fsdp-z3", "deepspeed-z2"): what a memory correction
        measured on one run applies to (hardware/profile.py MemoryCorrection)."""
        return f"{self.backend}-z{self.zero_stage}"

    @property
    def name(self) -> str:
        parts = [self.backend]
        if self.backend == "fsdp":
            parts.append("hybrid" if self.hybrid_shard else ("full" if self.zero_stage == 3 else "grad_op"))
        elif self.backend != "ddp":  # DeepSpeed's, and a registered backend's (its stage and hybrid shard)
            parts.append(f"z{self.zero_stage}" + ("-hybrid" if self.hybrid_shard else ""))
        if self.offload_optimizer != "none":
            parts.append(f"offload_opt_{self.offload_optimizer}")
        if self.offload_params != "none":
            parts.append(f"offload_param_{self.offload_params}")
        parts.append(self.precision)
        if self.activation_checkpointing:
            parts.append("ac")
        if self.activation_offload:
            parts.append("actoff")
        if self.embedding_offload:
            parts.append("embcpu")
        if self.loss_chunks:
            parts.append(f"ce{self.loss_chunks}")
        if self.mlp_tiles:
            parts.append(f"mlp{self.mlp_tiles}")
        if self.fused_kernels:
            parts.append("liger")
        if self.sequence_parallel > 1:
            parts.append(f"sp{self.sequence_parallel}")
        if self.optimizer != "adamw":
            parts.append(self.optimizer)
        parts.append(f"mb{self.micro_batch_size}")
        return "-".join(parts)

    @property
    def sharding(self) -> Sharding:
        return Sharding(self.backend, self.zero_stage, self.offload_optimizer, self.offload_params,
                        self.hybrid_shard)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Strategy:
        return cls(**data)


def data_parallel_size(strategy: Strategy, world_size: int) -> int:
    """Ranks that read different samples: the world over the sequence-parallel degree (the ranks of one
    sequence-parallel group read the same samples, each its slice of the sequence)."""
    return world_size // strategy.sequence_parallel


def tokens_per_step(strategy: Strategy, gradient_accumulation: int, world_size: int, seq_len: int) -> int:
    """Tokens one optimizer step trains on, over every rank: the one home of the formula (the speed
    model's tokens/s, the step record's tokens, the worker's intro line)."""
    return strategy.micro_batch_size * gradient_accumulation * data_parallel_size(strategy, world_size) * seq_len
