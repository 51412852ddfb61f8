"""The varlen attention path of packed chat / instruction samples (planner/packing.py): on a GPU plan
whose family supports it, with the flash-attn package installed, the model runs flash_attention_2 and
the data arrives as one row per micro-batch (data/sft_samples.py `flatten`). Otherwise the model keeps
sdpa and transformers builds the block-diagonal mask from the position ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrate.planner.packing import VARLEN, sample_packing

if TYPE_CHECKING:
    import torch

    from orchestrate.planner.plan import RunPlan


def planned_varlen(plan: RunPlan) -> bool:
    packing = sample_packing(plan.config, plan.hardware, plan.shape)
    return packing is not None and packing.attention == VARLEN


def varlen_ready(plan: RunPlan) -> bool:
    """The plan takes the varlen path and this process can run it (CUDA and flash-attn 2)."""
    if not planned_varlen(plan):
        return False
    from transformers.utils import is_flash_attn_2_available

    return is_flash_attn_2_available()


def packing_notice(plan: RunPlan) -> str | None:
    """What rank 0 says when the planned varlen path cannot run here (the mask is then not in the plan)."""
    if planned_varlen(plan) and not varlen_ready(plan):
        return ("packed samples: flash-attn 2 is not installed (pip install flash-attn): kept apart by sdpa with a "
                "block-diagonal mask instead, whose memory (micro-batch x seq_len^2 bytes per saved layer) the plan "
                "does not count")
    return None


def packed_attention(model: torch.nn.Module, plan: RunPlan) -> torch.nn.Module:
    """flash_attention_2 where `varlen_ready`; before the methods' transforms (methods/registry.py
    `apply_transforms`), which may wrap the HF model whose attention this sets."""
    if varlen_ready(plan):
        model.set_attn_implementation("flash_attention_2")
    return model
