"""Saved activations from each family's block structure (orchestrate/planner/activations.py).

The pure formulas are checked here for their structure; the slow test at the end runs a few zoo points
of bench/memory_accuracy.py through the fake-tensor simulation of the real backends.
"""

from __future__ import annotations

import dataclasses

import pytest

from orchestrate.model.formulas import shape_from_dict
from orchestrate.planner import activations as act

GPT2 = {"model_type": "gpt2", "n_layer": 12}  # openai-community/gpt2
TINYLLAMA = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
             "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
             "max_position_embeddings": 2048, "tie_word_embeddings": False}
QWEN2 = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
         "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}
MISTRAL = {"model_type": "mistral", "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 8,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 32768}
PHI3 = {"model_type": "phi3", "hidden_size": 1024, "intermediate_size": 2730, "num_hidden_layers": 8,
        "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32064}
GEMMA = {"model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 18,
         "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 256000}
CONFIGS = {"gpt2": GPT2, "llama": TINYLLAMA, "qwen2": QWEN2, "mistral": MISTRAL, "phi3": PHI3, "gemma": GEMMA}


def shape(name: str, **changes):
    s = shape_from_dict(CONFIGS[name])
    assert s is not None, name
    return dataclasses.replace(s, **changes)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_family_has_its_own_block_structure(name):
    assert name in act.FAMILY_BLOCKS
    s = shape(name)
    assert act.layer_bytes_per_token(s, 2) != act.FALLBACK_BYTES_PER_TOKEN_HIDDEN_16BIT * s.hidden_size


def test_the_formula_reproduces_the_simulated_per_layer_bytes():
    # orchestrate.simulate.activation_fit (1- and 2-block builds, FSDP2 full shard, bf16, seq 512, mb 1):
    # GPT-2 58.07 and TinyLlama-1.1B widths 42.57 bytes per layer per (token x hidden).
    for name, simulated in (("gpt2", 58.07), ("llama", 42.57)):
        s = shape(name)
        assert act.layer_bytes_per_token(s, 2) / s.hidden_size == pytest.approx(simulated, abs=0.02), name


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_grow_with_sequence_and_batch(name, checkpointing):
    s = shape(name)
    sizes = [act.activation_bytes(s, 2, tokens, checkpointing, logits=12 * tokens * s.vocab_size)
             for tokens in (512, 1024, 2048, 8192)]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("precision_bytes", [2, 4])
def test_checkpointing_keeps_less(name, precision_bytes):
    s, tokens = shape(name), 4096
    logits = 12 * tokens * s.vocab_size
    off = act.activation_bytes(s, precision_bytes, tokens, False, logits)
    on = act.activation_bytes(s, precision_bytes, tokens, True, logits)
    assert on < off
    # the recomputed block and its backward's gradients count only where they outgrow the freed logits
    no_logits = act.activation_bytes(s, precision_bytes, tokens, True, 0)
    last = (act.layer_bytes_per_token(s, precision_bytes)
            + act.backward_transient_bytes_per_token(s, precision_bytes)) * tokens
    assert abs(no_logits - on - min(logits, last)) <= 1  # int() rounding
    assert act.last_block_bytes(s, precision_bytes, tokens) == int(last)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_last_blocks_backward_gradients_show_where_the_logits_are_small(name):
    """A block's backward holds its output's gradient and up to four intermediate-sized MLP gradients;
    they raise the peak where they outgrow the freed logits (small vocabularies), checkpointed or not."""
    s, tokens = shape(name), 4096
    transient = (2 * s.hidden_size + act.MLP_BACKWARD_GRADIENTS * 2 * s.intermediate_size) * tokens
    assert act.backward_transient_bytes_per_token(s, 2) * tokens == transient
    layer = act.layer_bytes_per_token(s, 2) * tokens
    for checkpointing, added in ((False, transient), (True, layer + transient)):
        # logits of 0 bytes hide nothing; logits larger than what the last block adds hide all of it
        small, large = (act.activation_bytes(s, 2, tokens, checkpointing, logits) for logits in (0, 4 * (layer + transient)))
        assert abs((small - large) - added) <= 1, checkpointing


def test_gated_mlps_save_four_intermediates_and_gelu_new_five():
    # d(bytes)/d(intermediate) = tensors the MLP saves x 2 bytes
    for name, saved in (("llama", 4), ("qwen2", 4), ("mistral", 4), ("phi3", 4), ("gemma", 4), ("gpt2", 5)):
        s = shape(name)
        wider = dataclasses.replace(s, intermediate_size=s.intermediate_size + 100)
        assert act.layer_bytes_per_token(wider, 2) - act.layer_bytes_per_token(s, 2) == saved * 2 * 100, name


def test_grouped_query_attention_saves_smaller_keys_and_values():
    s = shape("llama")  # 32 query heads, 4 kv heads, head_dim 64
    mha = dataclasses.replace(s, num_kv_heads=s.num_heads)
    # k (rotated) and v, 2 bytes each per kv-head element
    assert act.layer_bytes_per_token(mha, 2) - act.layer_bytes_per_token(s, 2) == 2 * 2 * (32 - 4) * 64
    # Phi-3's fused qkv keeps the whole projection alive besides the rotated q and k
    p = shape("phi3")
    fewer = dataclasses.replace(p, num_kv_heads=p.num_kv_heads // 2)
    assert act.layer_bytes_per_token(p, 2) - act.layer_bytes_per_token(fewer, 2) == 3 * 2 * 8 * p.head_dim


def test_norms_layernorm_rmsnorm_and_gemmas_fp32_rmsnorm():
    h = 1000
    assert act.norm_bytes("layernorm", h, 2) == 2 * h + 8  # input + fp32 mean, rstd
    assert act.norm_bytes("rmsnorm", h, 2) == 6 * h + 4  # fp32 copy + 16-bit result + rsqrt
    assert act.norm_bytes("rmsnorm", h, 4) == 8 * h + 4
    assert act.norm_bytes("rmsnorm_fp32", h, 2) == 8 * h + 4


def test_dropout_masks_are_one_byte_and_only_where_the_family_has_dropout():
    assert act.FAMILY_BLOCKS["gpt2"].dropout_masks == 2
    assert all(act.FAMILY_BLOCKS[f].dropout_masks == 0 for f in ("llama", "mistral", "qwen2", "phi3", "gemma"))
    s = shape("gpt2")
    assert act.outside_bytes_per_token(s, 2) == act.MASK * s.hidden_size + (2 * s.hidden_size + 8) + 2 * s.hidden_size


def test_fp32_keeps_more_but_at_most_twice():
    for name in CONFIGS:
        s = shape(name)
        assert act.layer_bytes_per_token(s, 2) < act.layer_bytes_per_token(s, 4) <= 2 * act.layer_bytes_per_token(s, 2)


def test_unknown_families_fall_back_to_the_gpt2_measurement():
    s = shape("llama", model_type="somethingnew")
    assert act.layer_bytes_per_token(s, 2) == 62 * s.hidden_size
    assert act.outside_bytes_per_token(s, 2) == 0


@pytest.mark.slow
def test_zoo_points_are_within_five_percent_of_the_simulation():
    # A few points of bench/memory_accuracy.py (2-block models, two generic 8 GB GPUs), each a real
    # backend on fake tensors: ZeRO-3 on Qwen2 widths (tied 152k vocabulary), FSDP2 shard-grad-op with
    # checkpointing on Mistral widths, DDP on GPT-2.
    from bench.memory_accuracy import Point, compare, strategy
    from orchestrate.simulate import simulate_all

    points = [Point("qwen2", strategy("deepspeed", 3, 1, False), 512),
              Point("mistral", strategy("fsdp", 2, 2, True), 512),
              Point("gpt2", strategy("ddp", 0, 1, False), 512)]
    for point, sim in zip(points, simulate_all([point.plan() for point in points]), strict=True):
        row = compare(point, sim)
        assert abs(row["ratio"] - 1) <= 0.05, row
