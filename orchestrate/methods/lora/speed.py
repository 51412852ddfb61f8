"""What QLoRA's 4-bit linears cost beyond their FLOPs. Pure.

bitsandbytes runs each NF4 linear as a dequantization of the whole weight to the compute dtype followed
by a 16-bit GEMM (bitsandbytes/autograd/_functions.py MatMul4Bit: forward, and again in backward for the
input gradient), and peft adds the adapter's small matmuls beside it. Beyond the model's FLOPs at the GPU's
rate (planner/speed.py) each quantized linear takes a time per call that does not shrink with fewer tokens
(planner/constants.py QUANTIZED_LINEAR_SECONDS, where its measurement is), so QLoRA candidates with more
micro-batches, recompute or MLP slices rank as slower.
"""

from __future__ import annotations

from orchestrate.model.linears import block_linears
from orchestrate.model.shape import ModelShape
from orchestrate.planner import constants as k
from orchestrate.planner.strategy import Strategy

MLP_LINEARS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "c_fc", "c_proj")


def quantized_linear_seconds(shape: ModelShape, strategy: Strategy) -> float:
    """Seconds one micro-batch spends in the quantized linears beyond their FLOPs, in calls of half
    QUANTIZED_LINEAR_SECONDS (a forward or a backward: each dequantizes once): forward and backward, the
    forward again under activation checkpointing; a tiled MLP's linears run each call once per slice, and
    their backward recomputes the slice's forward first (DeepSpeed TiledMLP.backward)."""
    linears = block_linears(shape) or []
    recompute = 1 if strategy.activation_checkpointing else 0
    tiled = sum(name in MLP_LINEARS for name, _, _ in linears) if strategy.mlp_tiles else 0
    calls = (len(linears) - tiled) * (2 + recompute) + tiled * strategy.mlp_tiles * (3 + recompute)
    return shape.num_layers * calls * k.QUANTIZED_LINEAR_SECONDS / 2
