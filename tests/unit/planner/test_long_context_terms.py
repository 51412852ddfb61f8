"""The long-context memory and speed terms (planner/long_context.py, activations.BlockCompute): what a tiled
MLP, Liger's fused kernels and Ulysses sequence parallelism change in a rank's activations and step time,
checked against the formulas' sources by hand on the Llama-3-8B shape, and the QLoRA speed term against
the H200 session's measured tokens/s."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrate.model.shape import ModelShape
from orchestrate.planner import activations as act
from orchestrate.planner import long_context as lc
from orchestrate.planner.strategy import Strategy

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def llama8b() -> ModelShape:
    from orchestrate import api
    from orchestrate.model.meta import shape_for

    return shape_for(api.load_config(ROOT / "examples/llama3-8b.yaml", []))


def plain(**knobs) -> Strategy:
    return replace(Strategy("ddp", 0, "none", "none", "bf16", True, 1), **knobs)


def test_a_tiled_mlp_keeps_only_its_input_per_token(llama8b):
    h, i = llama8b.hidden_size, llama8b.intermediate_size
    untiled = act.layer_bytes_per_token(llama8b, 2)
    tiled = act.layer_bytes_per_token(llama8b, 2, compute=act.BlockCompute(mlp_tiles=8))
    assert untiled - tiled == 4 * 2 * i  # gate, SiLU(gate), up and their product, bf16
    assert tiled > 2 * h  # the attention half is untouched


def test_a_tiled_mlp_backward_holds_one_slice_and_the_full_input_gradient(llama8b):
    h, i, tokens = llama8b.hidden_size, llama8b.intermediate_size, 10_000
    compute = act.BlockCompute(mlp_tiles=4)
    slice_tokens = math.ceil(tokens / 4)
    assert act.tile_bytes(llama8b, 2, tokens, compute) == (4 + act.MLP_BACKWARD_GRADIENTS) * 2 * i * slice_tokens
    mlp_phase = 2 * 2 * h * tokens + act.tile_bytes(llama8b, 2, tokens, compute)
    attention_phase = act.attention_gradient_bytes_per_token(llama8b, 2, compute) * tokens
    assert act.backward_transient_bytes(llama8b, 2, tokens, compute) == max(mlp_phase, attention_phase)
    # untiled, the MLP's gradients are the larger phase, as before these knobs existed
    assert act.backward_transient_bytes(llama8b, 2, tokens) == act.backward_transient_bytes_per_token(llama8b, 2) * tokens


def test_more_tiles_shrink_only_the_slice(llama8b):
    few = act.tile_bytes(llama8b, 2, 65_536, act.BlockCompute(mlp_tiles=8))
    many = act.tile_bytes(llama8b, 2, 65_536, act.BlockCompute(mlp_tiles=64))
    assert few == 8 * many


def test_fused_kernels_save_the_norms_input_and_rstd_and_two_of_swiglus_inputs(llama8b):
    h, i = llama8b.hidden_size, llama8b.intermediate_size
    assert act.norm_bytes("rmsnorm", h, 2, fused=True) == 2 * h + 4
    fused = act.BlockCompute(fused=True)
    eager_norms = 2 * act.norm_bytes("rmsnorm", h, 2)
    saved = act.layer_bytes_per_token(llama8b, 2) - act.layer_bytes_per_token(llama8b, 2, compute=fused)
    assert saved == eager_norms - 2 * (2 * h + 4) + 2 * i  # the norms, and SiLU(gate) recomputed in backward
    assert act.mlp_saved(llama8b, fused) == 3


def test_sequence_parallelism_adds_the_exchanged_qkv_gradients_to_attention_backward(llama8b):
    q = llama8b.num_heads * llama8b.head_dim
    qkv = 2 * (q + 2 * llama8b.num_kv_heads * llama8b.head_dim)
    one = act.attention_gradient_bytes_per_token(llama8b, 2)
    two = act.attention_gradient_bytes_per_token(llama8b, 2, act.BlockCompute(sequence_parallel=2))
    assert two - one == qkv


def test_a_rank_holds_its_slice_of_the_sequence(llama8b):
    from orchestrate.planner.memory import activation_bytes, logits_bytes

    s = plain(backend="fsdp", zero_stage=3, sequence_parallel=4, loss_chunks=64, mlp_tiles=64)
    assert lc.local_seq_len(s, 32_768) == 8_192
    alone = replace(s, sequence_parallel=1)
    # a rank's logits are its slice's: the same as one rank's at a quarter of the length
    assert logits_bytes(llama8b, s, 8_192) == logits_bytes(llama8b, alone, 8_192)
    # with the MLP tiled by DeepSpeed's TiledMLP, attention's backward is the larger phase: its exchanged
    # gradients count
    assert activation_bytes(llama8b, s, 8_192) > activation_bytes(llama8b, alone, 8_192)


def test_ulysses_needs_heads_world_and_sequence_to_divide(llama8b):
    assert lc.sequence_parallel_degrees(llama8b, 8, 8_192) == [2, 4, 8]  # 32 heads, 8 key/value heads
    assert lc.sequence_parallel_degrees(llama8b, 6, 8_192) == [2]  # 3 and 6 divide neither the heads nor 8192
    assert lc.sequence_parallel_degrees(llama8b, 4, 8_190) == [2]
    problems = lc.long_context_problems(plain(sequence_parallel=3), llama8b, True, True, 6, 8_191)
    assert {p.where for p in problems} == {"train.sequence_parallel"}
    assert len(problems) == 2  # the heads and the length


def test_fused_kernels_need_a_gpu_liger_and_a_patched_family(llama8b):
    gpt2 = replace(llama8b, model_type="gpt2")
    on = plain(fused_kernels=True)
    messages = " | ".join(p.message for p in lc.long_context_problems(on, llama8b, False, True, 1, 1024))
    assert "GPU only" in messages
    assert "not installed" in " | ".join(p.message for p in lc.long_context_problems(on, llama8b, True, False, 1, 1024))
    assert "patches" in " | ".join(p.message for p in lc.long_context_problems(on, gpt2, True, True, 1, 1024))


def test_auto_tiles_one_slice_per_1024_tokens_and_none_below_two():
    assert lc.auto_mlp_tiles(1024) == 0
    assert lc.auto_mlp_tiles(1025) == 2
    assert lc.auto_mlp_tiles(45_952) == 45


def test_the_speed_model_prices_the_tiles_recompute_and_the_all_to_all(llama8b):
    from orchestrate.hardware.flags import HardwareFlags
    from orchestrate.planner.speed import estimate_speed

    hw = HardwareFlags(gpus=2, gpu_mem="8GiB", cpu_mem="64GiB", calibration=False).resolve()
    base = plain()
    untiled = estimate_speed(llama8b, hw, base, 16_384, 1)
    tiled = estimate_speed(llama8b, hw, replace(base, mlp_tiles=16), 16_384, 1)
    mlp_forward = 2 * 3 * llama8b.hidden_size * llama8b.intermediate_size * llama8b.num_layers
    ratio = (tiled.breakdown["recompute"] - untiled.breakdown["recompute"]) / untiled.breakdown["compute"]
    assert ratio == pytest.approx(mlp_forward / act_flops(llama8b, 16_384), rel=1e-9)
    assert untiled.breakdown["all_to_all"] == 0
    split = estimate_speed(llama8b, hw, replace(base, sequence_parallel=2), 16_384, 1)
    link = hw.gpu.pcie_bandwidth * (1.0 if hw.gpu.p2p else 0.5)
    exchanged = lc.all_to_all_bytes(llama8b, replace(base, sequence_parallel=2), 16_384, 2, passes=2)
    assert split.breakdown["all_to_all"] >= exchanged / max(link, hw.gpu.pcie_bandwidth)
    # two ranks on one sample: each computes half its tokens (at a little less of the GPU's rate: fewer
    # tokens saturate it less), and one step trains one sample
    assert split.breakdown["compute"] == pytest.approx(untiled.breakdown["compute"] / 2, rel=0.03)


def act_flops(shape: ModelShape, seq_len: int) -> float:
    from orchestrate.planner.speed import training_flops_per_token

    return training_flops_per_token(shape, seq_len)[0]


def test_qlora_tokens_per_s_as_the_h200_session_measured():
    """The two QLoRA runs of bench/results/h200-2026-12-04, planned again with their strategies pinned: the
    4-bit linears' time per micro-batch (methods/lora/speed.py) brings the prediction to the measured rate
    (it was 4.9-5.4x above it)."""
    from bench import gpu_check
    from orchestrate.hardware.profile import HardwareProfile

    session = json.loads((ROOT / "bench/results/h200-2026-12-04/gpu_check.json").read_text())
    hw = HardwareProfile.model_validate(session["hardware"])
    for name in ("qlora-ddp-chunked-loss", "qlora-fsdp2-full-shard"):
        run = session["plans"][name]
        config = gpu_check.config_for(name, 6, Path("/nonexistent"))
        config["train"]["micro_batch_size"] = run["prediction"]["micro_batch"]
        config["train"]["activation_checkpointing"] = "-ac-" in run["prediction"]["strategy"]
        predicted = gpu_check.predict(config, hw)
        assert predicted["strategy"] == run["prediction"]["strategy"]
        assert run["measured"]["tokens_per_s"] / predicted["tokens_per_s"] == pytest.approx(1.0, abs=0.15), name
