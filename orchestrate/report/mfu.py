"""Model FLOPs utilisation (MFU) of a measured tokens/s.

PaLM (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways", appendix B):
MFU = observed tokens/s x (6N + 12·L·H·Q·T) / peak FLOP/s of the whole system, where N is the
non-embedding parameter count and 12·L·H·Q·T the attention score/context matmuls (H·Q = hidden size,
T = sequence length). `orchestrate.planner.speed.training_flops_per_token` is exactly that sum
(2 x matmul parameters x 3 + 12·layers·seq·hidden), so the measured MFU and the planner's assumed
efficiency (`constants.GPU_MFU`) are the same quantity.

PaLM counts no recomputation in MFU (rematerialised FLOPs are "hardware FLOPs", their HFU); with
activation checkpointing the hardware also reruns the forward, 2N + 4·L·T·hidden more per token.
Both are returned: `mfu` by PaLM's definition, `hfu` including the recompute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrate.planner.speed import training_flops_per_token

if TYPE_CHECKING:
    from orchestrate.planner.plan import RunPlan


def peak_flops(plan: RunPlan) -> float | None:
    """Dense peak FLOP/s of all ranks together at the plan's precision; None where unknown (CPU)."""
    gpu = plan.hardware.gpu
    if gpu is None or not plan.hardware.has_gpu:
        return None
    per_gpu = {"bf16": gpu.peak_tflops_bf16, "fp16": gpu.peak_tflops_fp16,
               "fp32": gpu.peak_tflops_fp32}[plan.strategy.precision] * 1e12
    return per_gpu * plan.world_size if per_gpu > 0 else None


def utilisation(tokens_per_s: float, plan: RunPlan) -> dict[str, float]:
    """{"mfu": ..., "hfu": ...} for `tokens_per_s` over all ranks; {} where the peak is unknown
    (left out rather than 0, so a CPU run's plot shows no made-up line)."""
    peak = peak_flops(plan)
    if peak is None:
        return {}
    flops, recompute = training_flops_per_token(plan.shape, plan.config.train.seq_len)
    hardware = flops + (recompute if plan.strategy.activation_checkpointing else 0.0)
    return {"mfu": tokens_per_s * flops / peak, "hfu": tokens_per_s * hardware / peak}
