"""Ulysses sequence parallelism (DeepSpeed-Ulysses / ALST, `Strategy.sequence_parallel` = N > 1), the
worker's half: the process groups, the attention and the loss's reduction.

Consecutive ranks form a group (ranks 0..N-1, N..2N-1, ...); the ranks of one group read the same
samples, each its 1/N slice of the sequence (orchestrate/data/sequence_slices.py). Everything outside
attention is per position, so it runs on the slice; attention exchanges sequence for heads with an
all-to-all (each rank: the whole sequence for heads/N), attends, and exchanges back. That is DeepSpeed's
`UlyssesSPAttentionHF`, used here as it is, built on the group of this module rather than through its
`register_with_transformers`: that one makes its own groups (DeepSpeed's `parallel_state_sp`) and
replaces the model's core attention key for every model of the process, where the trained model alone
needs it. It runs under gloo on CPU tensors and without a DeepSpeed engine (DDP, FSDP2), once
`deepspeed.comm` wraps the existing process group.

The loss: a sample's is the token-weighted mean over the whole sequence, so each rank divides its
slice's summed cross-entropy by the group's token count and the group all-reduces it (`group_sum`:
an autograd all-reduce, whose backward sums the ranks' incoming gradients too, so each rank's
gradients come out N times its share). DDP, FSDP2 and ZeRO average gradients over the whole world, N
times the data-parallel ranks: the two factors cancel, and the gradients are the plain run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    import torch

    from orchestrate.planner.plan import RunPlan

ATTENTION = "ulysses_sdpa"
"""The attention implementation the trained model is switched to: a name of its own in transformers'
AttentionInterface, so no other model of the process changes, and none in its mask interface, so
transformers builds no mask for the local slice (DeepSpeed's wrapper drops masks and attends causally)."""


@dataclass(frozen=True)
class SequenceParallel:
    size: int
    index: int
    """This rank's place in its group: it holds positions [index, index + 1) x seq_len / size."""
    group: Any
    """The group's torch.distributed ProcessGroup."""


def sequence_parallel_step(size: int) -> str:
    """The line a backend's `steps` gets under sequence parallelism."""
    return (f"sequence parallelism over groups of {size} consecutive ranks: each reads its group's samples and "
            f"keeps 1/{size} of every sequence; attention all-to-alls sequence for heads (DeepSpeed's "
            "UlyssesSPAttentionHF); the loss is the whole sequences' (summed over the group), the gradients "
            "averaged over every rank as without it")


def sequence_parallel_problems(plan: RunPlan) -> list[Problem]:
    """Why the plan's sequence parallelism cannot run on its model (empty: it can). Pure. The planner
    guarantees the rest (planner/long_context.py: the degree divides the world, seq_len and the heads)."""
    config = plan.config
    if config.model.task != "causal-lm" or config.model.module is not None:
        return [Problem("train.sequence_parallel", "sequence parallelism trains causal LMs of Hugging Face "
                        "models (their attention is swapped for the all-to-all one)", "set it to 1")]
    return []


def start_sequence_parallel(plan: RunPlan, rank: int, world_size: int) -> SequenceParallel | None:
    """This rank's sequence-parallel group, None when the plan has none. Collective: every rank makes
    every group (torch.distributed.new_group is called by the whole world for each)."""
    n = plan.strategy.sequence_parallel
    if n == 1:
        return None
    problems = sequence_parallel_problems(plan)
    if problems:
        raise UserError("the plan's sequence parallelism cannot run", problems)
    import torch.distributed as dist

    groups = [dist.new_group(list(range(first, first + n))) for first in range(0, world_size, n)]
    return SequenceParallel(n, rank % n, groups[rank // n])


def use_ulysses_attention(model: torch.nn.Module, sequence: SequenceParallel, micro_batch_size: int) -> None:
    """Switch the Hugging Face model inside `model` (any wrapper) to attention over the whole sequence
    by all-to-all over heads in `sequence`'s group (module doc). Key/value heads fewer than the ranks
    are replicated (DeepSpeed's `kv_replication_factor`), each rank then holding one."""
    import deepspeed.comm
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # Here, not with the groups: the worker's preload thread may be importing DeepSpeed until the model
    # stage (two threads in one import see a half-initialised deepspeed.comm).
    deepspeed.comm.init_distributed(dist_backend=dist.get_backend())  # wraps the existing group (module doc)
    hf = getattr(model, "module", model)  # DDP and DeepSpeed keep the model in .module
    text = hf.config.get_text_config()
    attention = UlyssesSPAttentionHF(
        sdpa_attention_forward, micro_batch_size, text.num_attention_heads,
        getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        text.num_key_value_heads, text.num_hidden_layers, sequence.group, seq_length_is_variable=True)

    def ulysses(module, query, key, value, attention_mask, *args, **kwargs):
        # No mask exists for this name (ATTENTION); the core SDPA attends causally without one.
        return attention(module, query, key, value, None, *args, **kwargs)

    AttentionInterface.register(ATTENTION, ulysses)
    hf.set_attn_implementation(ATTENTION)


def group_sum(value: torch.Tensor, sequence: SequenceParallel) -> torch.Tensor:
    """`value` summed over the group, differentiably: the backward all-reduces the gradients too.
    Hand-written: torch.distributed.nn.functional.all_reduce, which does this, is deprecated (a
    FutureWarning each call) for a private module's functional collective."""
    import torch
    import torch.distributed as dist

    class GroupSum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
            out = tensor.clone()
            dist.all_reduce(out, group=sequence.group)
            return out

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            dist.all_reduce(grad, group=sequence.group)
            return grad

    return GroupSum.apply(value)


def group_tokens(targets: torch.Tensor, sequence: SequenceParallel) -> torch.Tensor:
    """The loss-carrying targets (not -100) of the group's whole sequences, at least 1 (an all-masked
    sample's loss is 0, not nan)."""
    import torch.distributed as dist

    count = (targets != -100).sum().float()
    dist.all_reduce(count, group=sequence.group)
    return count.clamp(min=1)
