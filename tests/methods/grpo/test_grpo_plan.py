"""How the planner prices a GRPO run (orchestrate/methods/grpo/memory.py): the issue's case, a
Qwen2.5-1.5B-shaped model under QLoRA with 8 completions of 1,024 tokens after a 256-token prompt, fits
one 8 GiB card and the plan names both phases; the rollout phase is the KV cache, the prefill and the
sampling scores, and counts where it exceeds the training step's activations and logits; under
parameter sharding it holds the whole model gathered besides, and the step time adds that gather."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from orchestrate import api
from orchestrate.config.load import config_from_dict
from orchestrate.errors import UserError
from orchestrate.hardware.flags import HardwareFlags
from orchestrate.methods.grpo.memory import ROLLOUT, gathered_weight_bytes, kv_cache_bytes, rollout_bytes
from orchestrate.methods.grpo.method import GRPO
from orchestrate.methods.registry import method_terms
from orchestrate.model.formulas import shape_from_dict
from orchestrate.planner import constants as k
from orchestrate.planner.memory import estimate_memory
from orchestrate.planner.speed import estimate_speed, ring_bandwidth
from orchestrate.simulate.verify import verify_plan
from tests.unit.planner.test_memory_model import strat

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo" / "qwen2.5-1.5b.yaml"
GPU_8GIB = HardwareFlags(gpus=1, gpu_mem="8GiB", cpu_mem="32GiB", calibration=False)


def test_qwen2_5_1_5b_qlora_with_8_completions_of_1024_tokens_fits_one_8_gib_card():
    plan = api.plan_from_file(EXAMPLE, [], GPU_8GIB.resolve())
    assert api.is_runnable(plan)
    chosen = plan.chosen
    assert chosen.strategy.backend == "ddp" and chosen.memory.gpu_total <= 8 * 2**30
    assert chosen.strategy.micro_batch_size == 1  # one prompt: its 8 completions are the forward's 8 rows
    lines, keys = GRPO.report(plan)
    assert any("rollout" in line and "training" in line for line in lines)
    assert set(keys["grpo_phases"]) == {"rollout", "training"}
    assert keys["grpo_phases"]["rollout"]["kv_cache"] == kv_cache_bytes(plan.shape, 8, 1280, 2)


def _long_rollout():
    config = config_from_dict({
        "model": {"architecture": {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024,
                                   "num_hidden_layers": 64, "num_attention_heads": 8, "num_key_value_heads": 8,
                                   "vocab_size": 1000, "max_position_embeddings": 8192}},
        "train": {"seq_len": 4096, "global_batch_size": 8},
        "grpo": {"num_generations": 16, "max_completion_length": 4000, "rewards": [{"kind": "format", "pattern": "x"}]}})
    return config, shape_from_dict(config.model.architecture), GPU_8GIB.resolve()


def test_the_rollout_phase_counts_where_it_exceeds_the_training_step():
    config, shape, hw = _long_rollout()
    terms = method_terms(config, shape, hw)
    s = strat("ddp", 0, micro=1, ac=True)
    memory = estimate_memory(shape, hw, s, 4096, methods=terms)
    rows = 16  # one prompt's completions
    rollout = sum(rollout_bytes(shape, config.grpo, rows, 4096, 2).values())
    step = memory.gpu["activations"] + memory.gpu["logits"]
    assert memory.gpu[ROLLOUT] == int(max(0.0, rollout - step)) and memory.gpu[ROLLOUT] > 0
    priced = terms[-1].priced(terms[-1], hw, s, 4096, 1)
    assert priced.compute_seconds > 0  # the rollout's time in the step


@pytest.mark.parametrize(("backend", "stage", "method", "gathered"), [
    ("deepspeed", 3, "full", lambda shape: 2 * shape.parameters),  # every weight in bf16
    # ZeRO-3 with the optimizer and the parameters offloaded: the gathered model is on the device all the same
    ("deepspeed+cpu", 3, "full", lambda shape: 2 * shape.parameters),
    ("deepspeed+cpu", 2, "full", lambda shape: 0),  # ZeRO-2 with the optimizer offloaded: weights whole
    ("fsdp", 3, "full", lambda shape: 2 * shape.parameters),
    # QLoRA: the blocks' weights in NF4 (4 bits and a 4-byte absmax per 64), the rest in bf16
    ("fsdp", 3, "qlora", lambda shape: shape.num_layers * shape.block_parameters * (0.5 + 4 / 64)
     + 2 * shape.root_parameters),
    ("fsdp", 2, "full", lambda shape: 0),  # shard-grad-op's forward keeps every block gathered already
    ("deepspeed", 2, "full", lambda shape: 0),  # the weights are whole on every rank
])
def test_under_parameter_sharding_the_rollout_holds_the_whole_model_gathered(backend, stage, method, gathered):
    """gather.py gathers the weights once for the rollout phase: the whole model beside the rank's shard."""
    _, shape, _ = _long_rollout()
    s = _offloaded(backend, stage)
    assert gathered_weight_bytes(shape, replace(s, micro_batch_size=16), method, 2) == pytest.approx(gathered(shape))
    config, _, hw = _long_rollout()
    if method != "full":
        config = config.model_copy(update={"train": config.train.model_copy(update={"method": method})})
    memory = estimate_memory(shape, hw, s, 4096, methods=method_terms(config, shape, hw))
    rollout = sum(rollout_bytes(shape, config.grpo, 16, 4096, 2).values()) + gathered(shape)
    step = memory.gpu["activations"] + memory.gpu["logits"]
    assert memory.gpu[ROLLOUT] == int(max(0.0, rollout - step))


def _offloaded(backend: str, stage: int):
    """strat(backend, stage) with activation checkpointing; "deepspeed+cpu": DeepSpeed's offload as GRPO
    is verified under it (the optimizer on the CPU, and at stage 3 the parameters too)."""
    name, _, offload = backend.partition("+")
    offload = offload or "none"
    return strat(name, stage, offload, offload if stage == 3 else "none", micro=1, ac=True)


def _without_rollout_gather(terms):
    """The GRPO terms (last) priced as before the rollout's gather had a time."""
    *others, grpo = terms

    def priced(method, hw, strategy, seq_len, accumulation):
        return replace(grpo.priced(method, hw, strategy, seq_len, accumulation), exposed_communication_seconds=0.0)

    return [*others, replace(grpo, priced=priced)]


@pytest.mark.parametrize(("backend", "stage", "num_iterations"), [
    ("deepspeed", 3, 1), ("fsdp", 3, 1), ("fsdp", 3, 2),  # μ = 2: one gather per two steps
    ("deepspeed+cpu", 3, 1), ("deepspeed+cpu", 3, 2),  # the offloaded partition crosses PCIe first
    ("ddp", 0, 1), ("fsdp", 2, 1), ("deepspeed+cpu", 2, 1),  # the weights are whole on every rank: no gather
])
def test_the_step_time_adds_the_rollout_phases_gather_under_parameter_sharding(backend, stage, num_iterations):
    """gather.py gathers the whole model once per rollout phase: (n-1)/n of its bytes over the ring per
    rank and one collective per FSDP unit, with ZeRO-3's parameters offloaded after the rank's 1/n of
    them crossed PCIe to the device, once per num_iterations steps, with nothing to overlap it."""
    config, shape, _ = _long_rollout()
    config = config.model_copy(update={"grpo": config.grpo.model_copy(update={"num_iterations": num_iterations})})
    hw = HardwareFlags(gpus=2, gpu_mem="8GiB", cpu_mem="32GiB", calibration=False).resolve()
    terms = method_terms(config, shape, hw)
    s = _offloaded(backend, stage)
    speed = estimate_speed(shape, hw, s, 4096, 2, methods=terms)
    without = estimate_speed(shape, hw, s, 4096, 2, methods=_without_rollout_gather(terms))
    gathered = gathered_weight_bytes(shape, replace(s, micro_batch_size=16), "full", 2)
    assert (gathered > 0) == (stage == 3)
    host_copy = 1 / 2 * gathered / hw.gpu.pcie_bandwidth if s.offload_params == "cpu" else 0.0
    expected = ((1 / 2 * gathered / ring_bandwidth(hw) + (shape.num_layers + 1) * k.COLLECTIVE_LATENCY_S + host_copy)
                / num_iterations if gathered else 0.0)
    assert speed.step_time_s - without.step_time_s == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert speed.breakdown.get("exposed_communication", 0.0) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("gpu_mem", "chosen", "gathered"), [
    ("8GiB", ("deepspeed", 3, "cpu", "cpu"), lambda shape: 2 * shape.parameters),  # the whole model, bf16
    ("10GiB", ("deepspeed", 2, "cpu", "none"), lambda shape: 0),  # ZeRO-2: the weights are whole already
])
def test_full_fine_tuning_on_one_small_card_plans_deepspeeds_offload_and_prices_the_rollouts_gather(
        gpu_mem, chosen, gathered):
    """The 1.5B model fully fine-tuned with GRPO fits one 8 or 10 GiB card only with DeepSpeed's offload
    (no candidate without it fits); under ZeRO-3 with the parameters offloaded the rollout phase holds the
    whole model gathered on the device, beside the host copy of the weights (the planner's own term)."""
    hw = HardwareFlags(gpus=1, gpu_mem=gpu_mem, cpu_mem="64GiB", calibration=False).resolve()
    plan = api.plan_from_file(EXAMPLE, ["train.method=full"], hw)
    assert api.is_runnable(plan)
    s = plan.chosen.strategy
    assert (s.backend, s.zero_stage, s.offload_optimizer, s.offload_params) == chosen
    assert not [c.strategy.name for c in plan.candidates if c.fits and c.strategy.offload_optimizer == "none"]
    _, keys = GRPO.report(plan)
    assert keys["grpo_phases"]["rollout"].get("gathered_weights", 0) == pytest.approx(gathered(plan.shape))
    memory = plan.chosen.memory
    assert bool(memory.cpu.get("offloaded_params")) == (s.offload_params == "cpu")  # the weights' host copy
    rollout = sum(keys["grpo_phases"]["rollout"].values())
    assert memory.gpu[ROLLOUT] == int(max(0.0, rollout - keys["grpo_phases"]["training"]))


def test_an_offloaded_strategy_is_taken_only_where_nothing_without_offload_fits():
    """GRPO's offload has run on CPU ranks only (method.py `offloaded_last`): on 2 × 24 GiB the 1.5B full
    fine-tune keeps a strategy without offload although an offloaded one fits and is estimated faster."""
    hw = HardwareFlags(gpus=2, gpu_mem="24GiB", cpu_mem="128GiB", calibration=False).resolve()
    plan = api.plan_from_file(EXAMPLE, ["train.method=full"], hw)
    s = plan.chosen.strategy
    assert (s.offload_optimizer, s.offload_params) == ("none", "none")
    offloaded = [c for c in plan.candidates if c.fits and c.strategy.offload_optimizer != "none"]
    assert max(c.speed.tokens_per_s for c in offloaded) > plan.chosen.speed.tokens_per_s


def test_plan_simulate_refuses_only_full_fine_tuning_with_a_reference_copy():
    """The simulation builds the trained model only: a frozen reference copy (full fine-tuning, beta > 0)
    is refused with the reason; beta 0, or LoRA's adapter-disabled reference, are simulated
    (test_grpo_simulation.py)."""
    big_card = HardwareFlags(gpus=1, gpu_mem="80GiB", cpu_mem="64GiB", calibration=False).resolve()
    plan = api.plan_from_file(EXAMPLE, ["train.method=full", "grpo.beta=0.04"], big_card)
    with pytest.raises(UserError) as refused:
        verify_plan(plan)
    assert "grpo.beta" in str(refused.value) and "frozen copy" in str(refused.value)
    for overrides in ([], ["train.method=full"], ["grpo.beta=0.04"]):
        config = api.load_config(EXAMPLE, overrides)
        assert GRPO.simulation_refusal(config) is None, overrides
