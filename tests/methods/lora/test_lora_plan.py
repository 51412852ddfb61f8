"""LoRA / QLoRA planning: config errors, the adapter and frozen-base memory terms against
hand-computed numbers, and the remedies that propose them."""

from __future__ import annotations

import pytest

from orchestrate.config.load import config_from_dict
from orchestrate.errors import UserError
from orchestrate.hardware.flags import HardwareFlags
from orchestrate.methods.lora.adapters import adapters_for, nf4_bits_per_param
from orchestrate.methods.lora.method import adapter_terms
from orchestrate.model.formulas import shape_from_dict
from orchestrate.planner.memory import estimate_memory
from orchestrate.planner.plan import Refusal
from orchestrate.planning import refusal_error, weigh
from tests.unit.planner.test_memory_model import cpu_hw, gpu_hw, strat

TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100}
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "max_position_embeddings": 8192, "tie_word_embeddings": False}
# Per block at r=4: q 4(64+64) + k 4(64+32) + v 4(64+32) + o 4(64+64) + gate, up, down 4(64+96) each.
TINY_BLOCK_ADAPTERS = 512 + 384 + 384 + 512 + 3 * 640
TINY_BLOCK_LINEAR_WEIGHTS = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96


def config(arch: dict, **train) -> object:
    return config_from_dict({"model": {"architecture": dict(arch)},
                             "train": {"seq_len": 32, "global_batch_size": 2, **train}})


def test_adapter_count_is_r_times_d_in_plus_d_out_of_every_block_linear():
    shape = shape_from_dict(dict(TINY))
    a = adapters_for(config(TINY, method="lora", lora={"r": 4}), shape)
    assert a.trainable == 2 * TINY_BLOCK_ADAPTERS
    only_qv = adapters_for(config(TINY, method="lora", lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}), shape)
    assert only_qv.trainable == 2 * (512 + 384)


def test_llama3_8b_all_linear_r16_is_peft_s_figure():
    # peft's print_trainable_parameters for Llama-3-8B, r=16 on all seven linears: 41,943,040.
    a = adapters_for(config(LLAMA3_8B, method="lora"), shape_from_dict(dict(LLAMA3_8B)))
    assert a.trainable == 41_943_040


def test_nf4_bits_follow_the_qlora_paper():
    assert nf4_bits_per_param(True) == pytest.approx(4.127, abs=1e-3)  # Dettmers et al. 2023, section 3
    assert nf4_bits_per_param(False) == 4.5


@pytest.mark.parametrize("backend,stage,n", [("ddp", 0, 1), ("fsdp", 3, 2)])
def test_lora_states_fp32_adapters_and_frozen_base_without_grads(backend, stage, n):
    shape = shape_from_dict(dict(TINY))
    a = adapters_for(config(TINY, method="lora", lora={"r": 4}), shape)
    mem = estimate_memory(shape, cpu_hw(2), strat(backend, stage, precision="fp32"), 32, 2, [adapter_terms(a, shape)])
    adapters = 2 * TINY_BLOCK_ADAPTERS
    assert mem.gpu["optimizer_states"] == 8 * adapters // n  # Adam m, v of the adapters only
    assert mem.gpu["gradients"] == 4 * adapters // n  # accumulation 2: gradients counted in full
    assert mem.gpu["weights"] == (4 * adapters + 4 * shape.parameters) // n  # fp32 on CPU, base frozen


def test_qlora_base_is_nf4_for_block_linears_and_16_bit_elsewhere():
    shape = shape_from_dict(dict(TINY))
    a = adapters_for(config(TINY, method="qlora", lora={"r": 4}), shape)
    mem = estimate_memory(shape, gpu_hw(1), strat("ddp", 0, precision="bf16"), 32, 1, [adapter_terms(a, shape)])
    quantized = 2 * TINY_BLOCK_LINEAR_WEIGHTS
    base = (shape.parameters - quantized) * 2 + quantized * nf4_bits_per_param(True) / 8
    assert mem.gpu["weights"] == int(4 * 2 * TINY_BLOCK_ADAPTERS + base)


@pytest.mark.parametrize("train,where", [
    ({"method": "lora", "lora": {"target_modules": ["query"]}}, "train.lora.target_modules"),
    ({"lora": {"r": 8}}, "train.lora"),
    ({"method": "lora", "quantization": {"double_quant": False}}, "train.quantization"),
])
def test_bad_adapter_settings_name_their_yaml_path(train, where):
    with pytest.raises(UserError) as err:
        adapters_for(config(TINY, **train), shape_from_dict(dict(TINY)))
    assert [p.where for p in err.value.problems] == [where]
    assert err.value.problems[0].fix


def test_rank_zero_is_refused_by_the_schema():
    with pytest.raises(UserError) as err:
        config(TINY, method="lora", lora={"r": 0})
    assert err.value.problems[0].where.startswith("train.lora.r")


@pytest.mark.parametrize("pins,where", [({"backend": "deepspeed", "zero_stage": 1}, "strategy.backend"),
                                         ({"backend": "fsdp", "zero_stage": 2}, "strategy.backend"),
                                         ({"backend": "fsdp", "offload": "cpu"}, "strategy.offload")])
def test_an_adapter_pinned_on_an_unverified_backend_is_one_error_naming_what_works(pins, where):
    cfg = config_from_dict({"model": {"architecture": dict(TINY)}, "strategy": pins,
                            "train": {"seq_len": 32, "global_batch_size": 2, "method": "qlora"}})
    with pytest.raises(UserError) as err:
        weigh(cfg, cpu_hw(2), shape_from_dict(dict(TINY)))
    assert [p.where for p in err.value.problems] == [where]
    assert "fsdp (zero_stage 3), deepspeed (zero_stage 2 or 3)" in err.value.problems[0].fix


def test_qlora_plans_only_verified_backends():
    plan = weigh(config(TINY, method="qlora"), cpu_hw(2), shape_from_dict(dict(TINY)))
    planned = {(c.strategy.backend, c.strategy.zero_stage, c.strategy.offload_optimizer, c.strategy.offload_params)
               for c in plan.candidates}
    assert planned == {("ddp", 0, "none", "none"), ("fsdp", 3, "none", "none"), ("deepspeed", 2, "none", "none"),
                       ("deepspeed", 3, "none", "none")}


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_under_zero_shards_adapter_states_and_the_base_only_at_stage_3(stage):
    shape = shape_from_dict(dict(TINY))
    a = adapters_for(config(TINY, method="lora", lora={"r": 4}), shape)
    mem = estimate_memory(shape, cpu_hw(2), strat("deepspeed", stage, precision="fp32"), 32, 1, [adapter_terms(a, shape)])
    adapters = 2 * TINY_BLOCK_ADAPTERS
    # DeepSpeed's fp32 master and Adam m, v partitions of the adapters (stage_1_and_2.py / stage3.py).
    assert mem.gpu["optimizer_states"] == 8 * adapters // 2
    assert mem.gpu["master_weights"] == 4 * adapters // 2
    # The compute-dtype adapters and frozen base: replicated at stage 2, partitioned at stage 3.
    whole = 4 * adapters + 4 * shape.parameters
    assert mem.gpu["weights"] == (whole if stage == 2 else whole // 2)


def test_full_training_that_does_not_fit_gets_lora_and_qlora_remedies_with_numbers():
    shape = shape_from_dict(dict(LLAMA3_8B))
    hw = HardwareFlags(gpus=1, gpu_mem="8GiB", cpu_mem="32GiB").resolve()
    plan = weigh(config_from_dict({"model": {"architecture": dict(LLAMA3_8B)},
                                   "train": {"seq_len": 4096, "global_batch_size": 8}}), hw, shape)
    assert isinstance(plan, Refusal)
    remedies = {p.fix.split(",")[0]: p.message for p in refusal_error(plan).problems if p.where == "train.method"}
    assert set(remedies) == {"train.method: lora", "train.method: qlora"}
    assert all("GiB" in m for m in remedies.values())
    assert not any("not supported" in p.fix for p in refusal_error(plan).problems)


@pytest.mark.parametrize("arch", [
    TINY, {**TINY, "model_type": "qwen2"}, {**TINY, "model_type": "mistral"},
    {**TINY, "model_type": "phi3", "pad_token_id": 0},
    {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 32}])
def test_block_linears_equal_the_transformers_modules(arch):
    import torch
    import transformers

    from orchestrate.model.linears import block_linears

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**arch))
    block = next(m for name, m in model.named_modules() if name.endswith(".0") and "layers" in name or name == "transformer.h.0")
    found = [(name.split(".")[-1], *(m.weight.shape[::-1] if isinstance(m, torch.nn.Linear) else m.weight.shape))
             for name, m in block.named_modules() if type(m).__name__ in ("Linear", "Conv1D")]
    assert found == [tuple(x) for x in block_linears(shape_from_dict(dict(arch)))]


def test_a_whole_dumped_config_plans_again():
    """RUN_DIR/config.yaml and plan.json hold every section with its defaults: not "set"."""
    from orchestrate.config.load import config_from_dict
    from orchestrate.methods.lora.adapters import adapters_for
    from orchestrate.planner.strategy import Strategy
    from tests.helpers.plans import make_plan

    plan = make_plan(Strategy("ddp", 0, "none", "none", "fp32", False, 2))
    again = config_from_dict(plan.config.model_dump(mode="json"))
    assert adapters_for(again, plan.shape) is None
