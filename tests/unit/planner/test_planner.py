"""The planner: required outcomes on 8 GB cards, pins, batch arithmetic, error messages, the speed
model's shape, the report, and monotonicity properties of the memory model (hypothesis).

Planning time is not asserted here; bench/plan_speed.py measures it.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from orchestrate.config.load import config_from_dict
from orchestrate.errors import UserError
from orchestrate.planner.memory import estimate_memory, node_host_bytes
from orchestrate.planner.plan import Refusal, RunPlan
from orchestrate.planner.report import plan_json, print_plan
from orchestrate.planner.speed import estimate_speed, training_flops_per_token
from orchestrate.planner.strategy import Strategy
from orchestrate.planning import require_feasible, weigh
from tests.unit.planner.test_memory_model import (
    RTX2070,
    RTX3070,
    cpu_hw,
    gpt2_shape,
    gpt2_xl,
    gpu_hw,
    llama2_7b,
    llama_shape,
    strat,
)

GiB = 2**30


def config(seq_len: int = 1024, global_batch: int = 32, train: dict | None = None, strategy: dict | None = None):
    data = {"model": {"architecture": {"model_type": "llama"}},
            "train": {"seq_len": seq_len, "global_batch_size": global_batch, **(train or {})}}
    if strategy:
        data["strategy"] = strategy
    return config_from_dict(data, None)


def tiny():
    return gpt2_shape(128, 4, vocab=257, positions=256, heads=4)


def wheres(exc: pytest.ExceptionInfo[UserError]) -> list[str]:
    return [p.where for p in exc.value.problems]


# --- required outcomes -------------------------------------------------------------------------------

def test_gpt2_xl_on_one_8gb_gpu_and_64gb_ram_chooses_a_fitting_offload_plan():
    hw = gpu_hw(1, ram_gib=64)
    plan = weigh(config(), hw, gpt2_xl())
    chosen = require_feasible(plan).chosen
    assert chosen.fits and chosen is plan.candidates[0]
    assert chosen.strategy.offload_optimizer != "none"
    assert chosen.memory.gpu_total <= 0.90 * 8 * GiB
    assert chosen.memory.cpu_total <= 0.85 * 64 * GiB
    assert chosen.strategy.precision == "bf16"
    assert chosen.gradient_accumulation * chosen.strategy.micro_batch_size == 32


def test_llama2_7b_with_64gb_ram_is_infeasible_and_names_the_cpu_overflow():
    plan = weigh(config(), gpu_hw(1, ram_gib=64), llama2_7b())
    assert isinstance(plan, Refusal) and plan.candidates and not any(c.fits for c in plan.candidates)
    with pytest.raises(UserError) as exc:
        require_feasible(plan)
    text = str(exc.value)
    assert "overflows CPU RAM by" in exc.value.headline
    assert re.search(r"CPU \d+\.\d GiB > 54\.4 GiB usable \(\+\d+\.\d GiB\)", exc.value.details)
    # the remedies are concrete: NVMe (with how much space), more RAM (how much), LoRA / QLoRA (predicted)
    assert "--nvme" in wheres(exc) and "hardware (RAM)" in wheres(exc) and wheres(exc).count("train.method") == 2
    assert "not supported by orchestrate yet" not in text
    nvme = next(p for p in exc.value.problems if p.where == "--nvme")
    assert "offload_opt_nvme" in nvme.message and re.search(r">= \d+\.\d GiB free", nvme.fix)


def test_llama2_7b_becomes_feasible_with_an_nvme_path():
    hw = gpu_hw(1, ram_gib=64, nvme_path="/mnt/nvme", nvme_free_bytes=500 * GiB)
    plan = weigh(config(), hw, llama2_7b())
    chosen = require_feasible(plan).chosen
    assert chosen.strategy.backend == "deepspeed" and chosen.strategy.zero_stage == 3
    assert chosen.strategy.offload_optimizer == "nvme" and chosen.strategy.offload_params != "none"
    assert 0 < chosen.memory.nvme_bytes <= 500 * GiB
    assert node_host_bytes(chosen.memory, hw) <= 0.85 * 64 * GiB


def test_nvme_path_from_the_config_enables_nvme_candidates_too():
    with_path = weigh(config(strategy={"nvme_path": "/mnt/nvme"}), gpu_hw(1), llama2_7b())
    without = weigh(config(), gpu_hw(1), llama2_7b())
    assert any(c.memory.nvme_bytes for c in with_path.candidates)
    assert not any("nvme" in c.name for c in without.candidates)
    assert isinstance(with_path, RunPlan)  # free space unknown: left to DeepSpeed at start-up


def test_too_small_nvme_is_an_nvme_overflow():
    hw = gpu_hw(1, ram_gib=64, nvme_path="/mnt/nvme", nvme_free_bytes=20 * GiB)
    plan = weigh(config(), hw, llama2_7b())
    assert isinstance(plan, Refusal)
    assert any(re.search(r"NVMe \d+\.\d GiB > 20\.0 GiB free", c.reason) for c in plan.candidates)
    with pytest.raises(UserError) as exc:
        require_feasible(plan)
    assert any("on NVMe" in p.message for p in exc.value.problems)


def test_more_gpus_remedy_is_computed():
    # GPT-2 XL without offload: one card is too small, eight share the states (ZeRO-3 / FSDP).
    plan = weigh(config(strategy={"offload": "none"}), gpu_hw(1, ram_gib=64), gpt2_xl())
    with pytest.raises(UserError) as exc:
        require_feasible(plan)
    gpus = next(p for p in exc.value.problems if p.where == "--gpus")
    assert re.fullmatch(r"--gpus [248]", gpus.fix)
    unpin = next(p for p in exc.value.problems if p.where == "strategy")
    assert "offload" in unpin.message  # the pin excludes the offload plans that fit


def test_shorter_seq_len_remedy():
    # A 1.5 GiB card: GPT-2 XL's logits and activations at 1024 tokens overflow even with every state
    # offloaded (ZeRO-3 so needs 1.48 GiB: 0.58 logits, 0.15 activations, 0.15 the
    # gathered LM head; 1.35 GiB usable); shorter sequences fit. (FSDP2's fp32 reduce-scatter input of the root unit,
    # 4 B x the 82M embedding parameters, is on the GPU even with CPU offload: it fits no length.) The
    # loss in one piece and the activations on the device: chunks and offload would make 1024 tokens fit.
    small = RTX3070.model_copy(update={"memory_bytes": 3 * GiB // 2})
    plan = weigh(config(train={"loss_chunks": 0, "activation_offload": False}), gpu_hw(1, gpu=small), gpt2_xl())
    with pytest.raises(UserError) as exc:
        require_feasible(plan)
    seq = next(p for p in exc.value.problems if p.where == "train.seq_len")
    assert re.fullmatch(r"train\.seq_len: (512|256|128|64)", seq.fix)


# --- batch arithmetic ----------------------------------------------------------------------------------

def test_global_batch_not_divisible_by_world_size_is_a_user_error_with_a_fix():
    with pytest.raises(UserError) as exc:
        weigh(config(global_batch=30), gpu_hw(4), gpt2_xl())
    problem = exc.value.problems[0]
    assert problem.where == "train.global_batch_size"
    assert "28" in problem.fix and "32" in problem.fix


def test_accumulation_is_global_over_micro_times_world():
    plan = weigh(config(global_batch=48), gpu_hw(2), gpt2_xl())
    for c in plan.candidates:
        assert c.gradient_accumulation * c.strategy.micro_batch_size * 2 == 48


def test_pinned_micro_batch_must_divide_the_per_rank_batch():
    with pytest.raises(UserError) as exc:
        weigh(config(global_batch=32, train={"micro_batch_size": 3}), gpu_hw(2), gpt2_xl())
    assert wheres(exc) == ["train.micro_batch_size"]
    assert "1, 2, 4, 8, 16" in exc.value.problems[0].fix


def test_one_row_per_strategy_keeping_its_best_micro_batch():
    plan = weigh(config(), gpu_hw(1), gpt2_xl())
    bases = [re.sub(r"-mb\d+$", "", c.name) for c in plan.candidates]
    assert len(bases) == len(set(bases))


def test_fitting_candidates_come_first_fastest_first():
    plan = weigh(config(), gpu_hw(2), gpt2_xl())
    fits = [c.fits for c in plan.candidates]
    assert fits == sorted(fits, reverse=True)
    # a candidate with activation offload (never run on a GPU) after those without it, however fast
    # (search._rank_key): here ZeRO-1, which fits only with it
    order = [(c.strategy.activation_offload, -c.speed.tokens_per_s) for c in plan.candidates if c.fits]
    assert order == sorted(order) and order[-1][0]
    assert plan.chosen is plan.candidates[0]


def test_rejected_reason_says_which_limit_and_by_how_much():
    plan = weigh(config(), gpu_hw(1), gpt2_xl())
    rejected = [c for c in plan.candidates if not c.fits]
    assert rejected and all(c.reason for c in rejected)
    assert any(re.fullmatch(r"GPU \d+\.\d GiB > 7\.2 GiB usable \(\+\d+\.\d GiB\)", c.reason) for c in rejected)
    assert all(c.reason == "" for c in plan.candidates if c.fits)


# --- pins -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pins,check", [
    ({"backend": "fsdp"}, lambda s: s.backend == "fsdp"),
    ({"backend": "deepspeed", "zero_stage": 2}, lambda s: s.backend == "deepspeed" and s.zero_stage == 2),
    ({"zero_stage": 3}, lambda s: s.zero_stage == 3),
    ({"offload": "none"}, lambda s: s.offload_optimizer == "none"),
    ({"offload": "cpu", "offload_params": True}, lambda s: (s.offload_optimizer, s.offload_params) == ("cpu", "cpu")),
    ({"offload_params": False}, lambda s: s.offload_params == "none"),
    ({"backend": "ddp"}, lambda s: s.backend == "ddp" and s.zero_stage == 0),
])
def test_strategy_pins_are_honoured(pins, check):
    plan = weigh(config(strategy=pins), gpu_hw(2), gpt2_xl())
    assert plan.candidates and all(check(c.strategy) for c in plan.candidates)


@pytest.mark.parametrize("train,check", [
    ({"micro_batch_size": 2}, lambda s: s.micro_batch_size == 2),
    ({"precision": "fp16"}, lambda s: s.precision == "fp16"),
    ({"precision": "fp32"}, lambda s: s.precision == "fp32"),
    ({"activation_checkpointing": True}, lambda s: s.activation_checkpointing),
    ({"activation_checkpointing": False}, lambda s: not s.activation_checkpointing),
])
def test_train_pins_are_honoured(train, check):
    plan = weigh(config(train=train), gpu_hw(2), gpt2_xl())
    assert plan.candidates and all(check(c.strategy) for c in plan.candidates)


def test_zero1_is_proposed_on_one_rank_only_when_pinned():
    assert not any(c.name.startswith("deepspeed-z1") for c in weigh(config(), gpu_hw(1), gpt2_xl()).candidates)
    pinned = weigh(config(strategy={"zero_stage": 1}), gpu_hw(1), gpt2_xl())
    assert pinned.candidates and all(c.name.startswith("deepspeed-z1") for c in pinned.candidates)


def test_auto_precision_per_hardware():
    assert {c.strategy.precision for c in weigh(config(), gpu_hw(1), gpt2_xl()).candidates} == {"bf16"}
    turing = weigh(config(), gpu_hw(1, gpu=RTX2070), gpt2_xl())
    assert {c.strategy.precision for c in turing.candidates} == {"fp16"}
    cpu = weigh(config(seq_len=128, global_batch=16), cpu_hw(2), tiny())
    assert {c.strategy.precision for c in cpu.candidates} == {"fp32"}


def test_bf16_pinned_on_turing_is_a_user_error():
    with pytest.raises(UserError) as exc:
        weigh(config(train={"precision": "bf16"}), gpu_hw(1, gpu=RTX2070), gpt2_xl())
    assert wheres(exc) == ["train.precision"]
    assert "fp16" in exc.value.problems[0].fix


@pytest.mark.parametrize("pins,hw,where", [
    ({"backend": "ddp", "offload": "cpu"}, gpu_hw(1), "strategy.offload"),
    ({"backend": "ddp", "zero_stage": 3}, gpu_hw(1), "strategy.zero_stage"),
    ({"backend": "fsdp", "zero_stage": 1}, gpu_hw(1), "strategy.zero_stage"),
    ({"offload": "nvme"}, gpu_hw(1), "strategy.offload"),  # no NVMe directory known
    ({"zero_stage": 2, "offload": "nvme", "nvme_path": "/nvme"}, gpu_hw(1), "strategy.offload"),
    ({"backend": "fsdp", "offload": "nvme", "nvme_path": "/nvme"}, gpu_hw(1), "strategy.offload"),
    ({"offload_params": True, "offload": "none"}, gpu_hw(1), "strategy.offload_params"),
    ({"offload_params": True, "zero_stage": 2}, gpu_hw(1), "strategy.offload_params"),
    ({"offload": "cpu"}, cpu_hw(2), "strategy.offload"),
])
def test_contradictory_pins_are_user_errors(pins, hw, where):
    with pytest.raises(UserError) as exc:
        weigh(config(seq_len=128, global_batch=16, strategy=pins), hw, tiny())
    assert where in wheres(exc)
    assert all(p.fix for p in exc.value.problems)


def test_hybrid_shard_only_across_nodes():
    one = weigh(config(), gpu_hw(2), gpt2_xl())
    two = weigh(config(), gpu_hw(2, nodes=2), gpt2_xl())
    assert not any(c.strategy.hybrid_shard for c in one.candidates)
    assert any(c.strategy.hybrid_shard for c in two.candidates)


def test_cpu_only_profile_plans_without_offload_and_checks_the_node_total():
    plan = weigh(config(seq_len=128, global_batch=16), cpu_hw(2, ram_gib=16), tiny())
    assert isinstance(plan, RunPlan)
    assert all(c.strategy.offload_optimizer == "none" for c in plan.candidates)
    assert plan.chosen.memory.gpu["cuda_context"] == 0
    # RAM too small for two 1 GiB process runtimes: the node total, not the host dict alone, decides.
    starved = weigh(config(seq_len=128, global_batch=16), cpu_hw(2, ram_gib=2), tiny())
    assert isinstance(starved, Refusal)
    assert all(c.reason.startswith("CPU ") for c in starved.candidates)


# --- speed model ----------------------------------------------------------------------------------

def test_flops_are_six_per_parameter_per_token_plus_attention():
    shape = llama2_7b()
    flops, recompute = training_flops_per_token(shape, 2048)
    matmul = shape.parameters - shape.embedding_parameters
    assert flops == 6 * matmul + 12 * shape.num_layers * 2048 * shape.hidden_size
    assert recompute == flops / 3


def test_recompute_costs_a_third_more_compute():
    hw, shape = gpu_hw(1), gpt2_xl()
    plain = estimate_speed(shape, hw, strat("ddp", 0), 1024, 8)
    ac = estimate_speed(shape, hw, strat("ddp", 0, ac=True), 1024, 8)
    assert ac.breakdown["recompute"] == pytest.approx(plain.breakdown["compute"] / 3)
    assert ac.tokens_per_s < plain.tokens_per_s


def test_no_communication_on_one_rank_and_nvlink_beats_pcie_without_p2p():
    shape = gpt2_xl()
    assert estimate_speed(shape, gpu_hw(1), strat(), 1024, 4).breakdown["communication"] == 0
    pcie = estimate_speed(shape, gpu_hw(2), strat(), 1024, 4).breakdown["communication"]
    nvlink = estimate_speed(shape, gpu_hw(2, gpu=RTX3070.model_copy(update={"nvlink": True})), strat(), 1024, 4)
    assert 0 < nvlink.breakdown["communication"] < pcie


def test_sharded_stages_communicate_more_than_ddp_and_across_nodes_is_slower():
    shape, hw = gpt2_xl(), gpu_hw(4)
    ddp = estimate_speed(shape, hw, strat("ddp", 0), 1024, 1).breakdown["communication"]
    z3 = estimate_speed(shape, hw, strat(), 1024, 1).breakdown["communication"]
    assert z3 > ddp * 0.7  # 3 x 2-byte passes vs one 2 x 4-byte all-reduce
    nodes = estimate_speed(shape, gpu_hw(2, nodes=2), strat(), 1024, 1).breakdown["communication"]
    assert nodes > z3


def test_offload_costs_pcie_cpu_optimizer_and_nvme_time():
    shape, hw = llama2_7b(), gpu_hw(1, nvme_path="/nvme", nvme_free_bytes=500 * GiB)
    cpu = estimate_speed(shape, hw, strat(opt="cpu", params="cpu", ac=True), 1024, 32)
    nvme = estimate_speed(shape, hw, strat(opt="nvme", params="nvme", ac=True), 1024, 32)
    assert cpu.breakdown["offload_transfer"] > 0 and cpu.breakdown["cpu_optimizer"] > 0
    assert cpu.breakdown["nvme_io"] == 0 < nvme.breakdown["nvme_io"]
    assert nvme.tokens_per_s < cpu.tokens_per_s
    fsdp = estimate_speed(shape, hw, strat("fsdp", 3, "cpu", "cpu", ac=True), 1024, 32)
    assert fsdp.breakdown["cpu_optimizer"] > cpu.breakdown["cpu_optimizer"]  # torch's CPU Adam is slower


def test_tokens_per_second_counts_every_rank():
    shape = gpt2_xl()
    one = estimate_speed(shape, gpu_hw(1), strat("ddp", 0), 1024, 4)
    assert one.tokens_per_s == pytest.approx(4 * 1024 / one.step_time_s)


# --- report and JSON ---------------------------------------------------------------------------------

def test_plan_json_schema_and_round_trip():
    plan = weigh(config(), gpu_hw(1), gpt2_xl())
    data = json.loads(json.dumps(plan_json(plan)))
    assert data["model"]["parameters"] == 1_557_611_200
    assert data["hardware"]["gpus_per_node"] == 1
    assert data["chosen"] == plan.chosen.name
    assert data["limits"]["gpu_bytes_usable_per_rank"] == int(0.9 * 8 * GiB)
    for entry in data["candidates"]:
        assert {"name", "fits", "gpu_bytes_per_rank", "cpu_bytes_per_node", "host_bytes_per_node",
                "tokens_per_s", "reason"} <= set(entry)
        assert isinstance(entry["gpu_bytes_per_rank"], int)
    again = RunPlan.model_validate(plan.to_dict())
    assert again.chosen.name == plan.chosen.name and again.chosen.memory == plan.chosen.memory


def test_plan_json_without_a_fitting_candidate_has_chosen_null():
    data = plan_json(weigh(config(), gpu_hw(1), llama2_7b()))
    assert data["chosen"] is None and data["candidates"]


def test_report_prints_every_candidate_and_the_chosen_breakdown():
    plan = weigh(config(), gpu_hw(1), gpt2_xl())
    console = Console(record=True, width=250)
    print_plan(plan, console)
    text = console.export_text()
    assert all(c.name in text for c in plan.candidates)
    assert "Memory breakdown" in text and "offloaded_optimizer" in text and "Step time" in text


# --- properties ------------------------------------------------------------------------------------

FAMILIES_GPU = [("ddp", 0, "none", "none", False), ("deepspeed", 1, "none", "none", False),
                ("deepspeed", 2, "cpu", "none", False), ("deepspeed", 3, "none", "none", False),
                ("deepspeed", 3, "cpu", "cpu", False), ("deepspeed", 3, "nvme", "nvme", False),
                ("fsdp", 2, "none", "none", False), ("fsdp", 3, "none", "none", False),
                ("fsdp", 3, "cpu", "cpu", False), ("fsdp", 3, "none", "none", True)]
SHARDED = [f for f in FAMILIES_GPU if f[0] != "ddp"]

families = st.sampled_from(FAMILIES_GPU)
precisions = st.sampled_from(["bf16", "fp16", "fp32"])


def _strategy(family, precision, ac, micro) -> Strategy:
    backend, stage, opt, params, hybrid = family
    return Strategy(backend, stage, opt, params, precision, ac, micro, hybrid)


def _totals(shape, hw, strategy, seq, accumulation=2):
    mem = estimate_memory(shape, hw, strategy, seq, accumulation)
    return mem.gpu_total, node_host_bytes(mem, hw), mem.nvme_bytes


@settings(max_examples=60, deadline=None)
@given(families, precisions, st.booleans(), st.integers(1, 16), st.integers(1, 16), st.sampled_from([128, 512, 2048]),
       st.integers(1, 4))
def test_memory_grows_with_micro_batch(family, precision, ac, a, b, seq, accumulation):
    hw, shape = gpu_hw(2, nodes=2 if family[4] else 1), gpt2_xl()
    small, large = sorted((a, b))
    lo = _totals(shape, hw, _strategy(family, precision, ac, small), seq, accumulation)
    hi = _totals(shape, hw, _strategy(family, precision, ac, large), seq, accumulation)
    assert all(x <= y for x, y in zip(lo, hi, strict=True))


@settings(max_examples=60, deadline=None)
@given(families, precisions, st.booleans(), st.integers(1, 8), st.integers(16, 8192), st.integers(16, 8192),
       st.integers(1, 4))
def test_memory_grows_with_seq_len(family, precision, ac, micro, a, b, accumulation):
    hw, shape = gpu_hw(2, nodes=2 if family[4] else 1), llama2_7b()
    short, long = sorted((a, b))
    strategy = _strategy(family, precision, ac, micro)
    lo = _totals(shape, hw, strategy, short, accumulation)
    hi = _totals(shape, hw, strategy, long, accumulation)
    assert all(x <= y for x, y in zip(lo, hi, strict=True))


@settings(max_examples=60, deadline=None)
@given(families, precisions, st.booleans(), st.integers(2, 48), st.integers(2, 48),
       st.sampled_from([(1024, 2816), (2048, 5632), (4096, 11008)]), st.integers(1, 4))
def test_memory_grows_with_parameters(family, precision, ac, a, b, dims, accumulation):
    hw = gpu_hw(2, nodes=2 if family[4] else 1)
    few, many = sorted((a, b))
    strategy = _strategy(family, precision, ac, 2)
    lo = _totals(llama_shape(dims[0], few, dims[1]), hw, strategy, 1024, accumulation)
    hi = _totals(llama_shape(dims[0], many, dims[1]), hw, strategy, 1024, accumulation)
    assert all(x <= y for x, y in zip(lo, hi, strict=True))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SHARDED), precisions, st.booleans(), st.integers(1, 8), st.integers(1, 4),
       st.sampled_from([(2, 4), (2, 8), (4, 8)]), st.booleans())
def test_sharded_gpu_memory_shrinks_with_more_ranks(family, precision, ac, micro, accumulation, ranks, across_nodes):
    # From 2 ranks up (a single rank has no communicator, so NCCL buffers appear at 2). More ranks
    # either as more GPUs in a node or as more 2-GPU nodes; hybrid shard needs >= 2 nodes and shards
    # only inside a node, so it gets more GPUs per node.
    few, many = ranks
    strategy = _strategy(family, precision, ac, micro)
    if family[4]:
        small, large = gpu_hw(few, nodes=2), gpu_hw(many, nodes=2)
    elif across_nodes:
        small, large = gpu_hw(2, nodes=few // 2), gpu_hw(2, nodes=many // 2)
    else:
        small, large = gpu_hw(few), gpu_hw(many)
    shape = llama2_7b()
    assert (estimate_memory(shape, large, strategy, 1024, accumulation).gpu_total
            <= estimate_memory(shape, small, strategy, 1024, accumulation).gpu_total)
