"""The memory knobs the planner chooses (planner/knobs.py): chunked cross-entropy, activation offload,
the 8-bit optimizer and train.method auto. Pure planner: terms against hand-computed numbers, what the
search picks and when, what it refuses (one error naming what works)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrate.config.load import config_from_dict
from orchestrate.errors import UserError
from orchestrate.hardware.flags import HardwareFlags
from orchestrate.methods.lora.adapters import adapters_for
from orchestrate.methods.lora.method import adapter_terms
from orchestrate.model.formulas import shape_from_dict
from orchestrate.planner import constants as k
from orchestrate.planner import knobs
from orchestrate.planner.memory import estimate_memory
from orchestrate.planner.plan import Refusal, RunPlan
from orchestrate.planner.speed import estimate_speed
from orchestrate.planning import weigh
from tests.methods.lora.test_lora_plan import LLAMA3_8B, TINY
from tests.unit.planner.test_memory_model import cpu_hw, gpu_hw, strat

GiB = 2**30


def cfg(arch: dict, seq: int = 32, batch: int = 2, **train) -> object:
    return config_from_dict({"model": {"architecture": dict(arch)},
                             "train": {"seq_len": seq, "global_batch_size": batch, **train}})


def test_chunked_logits_are_one_chunk_plus_the_hidden_gradient():
    shape = shape_from_dict(dict(LLAMA3_8B))
    whole = estimate_memory(shape, gpu_hw(1), strat("ddp", 0, ac=True), 4096)
    chunked = estimate_memory(shape, gpu_hw(1), replace(strat("ddp", 0, ac=True), loss_chunks=16), 4096)
    assert whole.gpu["logits"] == k.LOGITS_BYTES_PER_TOKEN_VOCAB_16BIT * 4096 * 128256  # 5.9 GiB
    assert chunked.gpu["logits"] == k.LOGITS_BYTES_PER_TOKEN_VOCAB_16BIT * 256 * 128256 + 2 * 4096 * 4096


def test_chunked_loss_costs_the_lm_head_forward_again():
    shape, hw = shape_from_dict(dict(LLAMA3_8B)), gpu_hw(1)
    base = estimate_speed(shape, hw, strat("ddp", 0), 4096, 1)
    chunked = estimate_speed(shape, hw, replace(strat("ddp", 0), loss_chunks=16), 4096, 1)
    extra = chunked.breakdown["recompute"] - base.breakdown["recompute"]
    # the extra over the whole forward+backward compute is 2·V·h per token over 6·P_matmul + attention
    ratio = extra / base.breakdown["compute"]
    flops_fwd_bwd = 6 * (shape.parameters - shape.embedding_parameters) + 12 * 32 * 4096 * 4096
    assert ratio == pytest.approx(2 * 128256 * 4096 / flops_fwd_bwd, rel=1e-9)


def test_activation_offload_moves_the_block_inputs_to_host_and_charges_pcie():
    shape, hw = shape_from_dict(dict(LLAMA3_8B)), gpu_hw(1)
    on, off = replace(strat("ddp", 0, ac=True), activation_offload=True), strat("ddp", 0, ac=True)
    block_input = 2 * 4096 * 4096  # bf16 input of one block (Korthikanti et al. 4.1)
    m_on, m_off = estimate_memory(shape, hw, on, 4096), estimate_memory(shape, hw, off, 4096)
    assert m_off.gpu["activations"] - m_on.gpu["activations"] == (32 - 2) * block_input
    assert m_on.cpu["offloaded_activations"] == 32 * block_input and m_off.cpu["offloaded_activations"] == 0
    s_on, s_off = estimate_speed(shape, hw, on, 4096, 1), estimate_speed(shape, hw, off, 4096, 1)
    assert s_on.breakdown["offload_transfer"] == pytest.approx(2 * 32 * block_input / hw.gpu.pcie_bandwidth)
    assert s_off.breakdown["offload_transfer"] == 0


def test_adamw8bit_states_are_about_2_bytes_per_parameter():
    shape = shape_from_dict(dict(TINY))
    adamw = estimate_memory(shape, cpu_hw(2), strat("ddp", 0, precision="fp32"), 32, 2)
    bnb = estimate_memory(shape, cpu_hw(2), replace(strat("ddp", 0, precision="fp32"), optimizer="adamw8bit"), 32, 2)
    assert adamw.gpu["optimizer_states"] == 8 * shape.parameters
    assert bnb.gpu["optimizer_states"] == int(shape.parameters * (2 + 8 / 256))


def test_knobs_are_chosen_only_where_the_plain_run_does_not_fit():
    shape = shape_from_dict(dict(TINY))
    roomy = weigh(cfg(TINY, optimizer={"name": "auto"}), cpu_hw(2, ram_gib=16), shape).strategy
    assert (roomy.loss_chunks, roomy.activation_offload, roomy.optimizer) == (0, False, "adamw")
    hw = HardwareFlags(gpus=1, gpu_mem="12GiB", cpu_mem="32GiB").resolve()
    plan = weigh(cfg(LLAMA3_8B, seq=4096, batch=8, method="qlora", optimizer={"name": "auto"}), hw,
                 shape_from_dict(dict(LLAMA3_8B)))
    tight = plan.strategy
    assert tight.loss_chunks == knobs.auto_loss_chunks(4096) and tight.activation_checkpointing
    assert tight.optimizer == "adamw"  # 0.3 GiB of fp32 Adam states fit: the 8-bit optimizer is not needed
    # the 128k-vocabulary logits do not fit unchunked (but with the base offloaded to the host, ZeRO-3 fits
    # them: tests/methods/lora/test_lora_offload_plan.py)
    whole = weigh(cfg(LLAMA3_8B, seq=4096, batch=8, method="qlora", optimizer={"name": "auto"}, loss_chunks=0),
                  hw, shape_from_dict(dict(LLAMA3_8B)))
    unchunked = [c for c in whole.candidates if c.strategy.offload_params == "none"]
    assert unchunked and all(not c.fits for c in unchunked)


def test_llama3_8b_qlora_host_load_is_one_tensor_not_the_fp32_model():
    shape, hw = shape_from_dict(dict(LLAMA3_8B)), HardwareFlags(gpus=1, gpu_mem="8GiB", cpu_mem="32GiB").resolve()
    a = adapters_for(cfg(LLAMA3_8B, method="qlora"), shape)
    mem = estimate_memory(shape, hw, replace(strat("ddp", 0, ac=True), loss_chunks=16), 4096, 1, [adapter_terms(a, shape)])
    # embedding (128256 x 4096) read in fp32 and cast to bf16: 6 B x 525M = 2.9 GiB, less the steady host bytes
    assert mem.cpu["loading_spike"] <= 6 * 128256 * 4096
    full = estimate_memory(shape, hw, strat("ddp", 0, ac=True), 4096)
    assert full.cpu["loading_spike"] > 4 * shape.parameters - 1 * GiB


@pytest.mark.parametrize("pins,where,fix", [
    ({"strategy": {"backend": "fsdp"}, "train": {"optimizer": {"name": "adamw8bit"}}}, "train.optimizer.name", "ddp"),
    ({"strategy": {"backend": "deepspeed"}, "train": {"optimizer": {"name": "adamw8bit"}}}, "train.optimizer.name",
     "ddp"),
    ({"train": {"activation_offload": True}}, "train.activation_offload", "false"),
])
def test_pinned_knobs_that_cannot_run_get_one_error_naming_what_works(pins, where, fix):
    data = {"model": {"architecture": dict(TINY)}, "train": {"seq_len": 32, "global_batch_size": 2}}
    for section, values in pins.items():
        data.setdefault(section, {}).update(values)
    with pytest.raises(UserError) as err:
        weigh(config_from_dict(data), cpu_hw(2), shape_from_dict(dict(TINY)))
    assert where in [p.where for p in err.value.problems]
    assert any(fix in p.fix for p in err.value.problems if p.where == where)


def test_loss_chunks_and_activation_offload_pinned_under_deepspeed_are_planned_there():
    # DeepSpeed runs both since tests/unit/backends/test_memory_knobs_train.py trained with each on ZeRO-2 and ZeRO-3
    data = {"model": {"architecture": dict(TINY)}, "strategy": {"backend": "deepspeed"},
            "train": {"seq_len": 32, "global_batch_size": 2, "loss_chunks": 4, "activation_offload": True}}
    plan = weigh(config_from_dict(data), gpu_hw(2), shape_from_dict(dict(TINY)))
    assert plan.candidates and all((c.strategy.backend, c.strategy.loss_chunks, c.strategy.activation_offload)
                                   == ("deepspeed", 4, True) for c in plan.candidates)
    assert plan.chosen.fits and {c.strategy.zero_stage for c in plan.candidates} == {1, 2, 3}


def test_adamw8bit_pinned_with_backend_auto_plans_ddp_only():
    plan = weigh(cfg(TINY, optimizer={"name": "adamw8bit"}), cpu_hw(2), shape_from_dict(dict(TINY)))
    assert {c.strategy.backend for c in plan.candidates} == {"ddp"}
    assert plan.strategy.optimizer == "adamw8bit" and plan.chosen.name.endswith("adamw8bit-mb1")


def test_method_auto_is_full_when_full_fits_even_with_lora_settings_given():
    plan = weigh(cfg(TINY, method="auto", lora={"r": 4}), cpu_hw(2), shape_from_dict(dict(TINY)))
    assert plan.config.train.method == "full" and isinstance(plan, RunPlan)
    # (a config without data also gets the packing note: its records are detected at launch)
    assert [n for n in plan.notes if n.startswith("train.method auto")] == [
        "train.method auto: full, the most faithful method that fits"]


def test_method_auto_takes_the_first_of_full_lora_qlora_that_fits():
    shape = shape_from_dict(dict(LLAMA3_8B))
    hw = HardwareFlags(gpus=1, gpu_mem="24GiB", cpu_mem="64GiB").resolve()
    base = {"seq": 1024, "batch": 8}
    fits = {m: isinstance(weigh(cfg(LLAMA3_8B, **base, method=m), hw, shape), RunPlan)
            for m in ("full", "lora", "qlora")}
    assert fits == {"full": False, "lora": True, "qlora": True}  # 16 GiB bf16 base + adapters fit 24 GiB
    plan = weigh(cfg(LLAMA3_8B, **base, method="auto"), hw, shape)
    assert plan.config.train.method == "lora" and isinstance(plan, RunPlan)
    auto = [n for n in plan.notes if n.startswith("train.method auto")]
    assert len(auto) == 1 and auto[0].startswith("train.method auto: lora, the most faithful method that fits (full does not fit")
    assert plan.to_dict()["notes"] == plan.notes


def test_method_auto_when_nothing_fits_shows_qlora_and_says_so():
    shape = shape_from_dict(dict(LLAMA3_8B))
    # 2 GiB: on 4 GiB QLoRA fits with the base offloaded under ZeRO-3 (its 16-bit LM head gathered alone)
    hw = HardwareFlags(gpus=1, gpu_mem="2GiB", cpu_mem="32GiB").resolve()
    plan = weigh(cfg(LLAMA3_8B, seq=1024, batch=8, method="auto"), hw, shape)
    assert isinstance(plan, Refusal) and plan.config.train.method == "qlora"
    auto = [n for n in plan.notes if n.startswith("train.method auto")]
    assert len(auto) == 1 and auto[0].startswith("train.method auto: nothing fits (full does not fit")


def test_a_knob_pinned_off_that_would_fit_is_a_remedy():
    from orchestrate.planning import refusal_error

    shape = shape_from_dict(dict(LLAMA3_8B))
    hw = HardwareFlags(gpus=1, gpu_mem="12GiB", cpu_mem="32GiB").resolve()
    pinned = config_from_dict({"model": {"architecture": dict(LLAMA3_8B)}, "strategy": {"offload": "none"},
                               "train": {"seq_len": 4096, "global_batch_size": 8, "method": "qlora", "loss_chunks": 0}})
    plan = weigh(pinned, hw, shape)  # without offload (the base offloaded, ZeRO-3 fits the logits)
    assert isinstance(plan, Refusal)  # the 5.9 GiB of unchunked logits
    remedies = {p.where: p for p in refusal_error(plan).problems}
    assert remedies["train.loss_chunks"].fix == "train.loss_chunks: auto"
    assert "-ce16-" in remedies["train.loss_chunks"].message and "fits" in remedies["train.loss_chunks"].message


def test_loss_chunks_pinned_for_a_task_without_a_causal_lm_loss_is_one_error():
    arch = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "vocab_size": 100}
    data = {"model": {"architecture": arch, "task": "masked-lm"},
            "train": {"seq_len": 32, "global_batch_size": 2, "loss_chunks": 4}, "data": {"packing": False}}
    with pytest.raises(UserError) as err:
        weigh(config_from_dict(data), cpu_hw(2), shape_from_dict(dict(arch)))
    assert [p.where for p in err.value.problems] == ["train.loss_chunks"]
