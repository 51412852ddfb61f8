"""Planning LoRA / QLoRA with the frozen base offloaded to host memory (DeepSpeed ZeRO-3,
offload_param cpu + offload_optimizer cpu, methods/lora/offload.py): what is allowed, what is
refused with one error naming what works, and the memory and speed terms against hand-computed
numbers."""

from __future__ import annotations

import pytest

from orchestrate.config.load import config_from_dict
from orchestrate.errors import UserError
from orchestrate.methods.lora.adapters import adapters_for, verified_shardings
from orchestrate.methods.lora.memory import base_bytes
from orchestrate.methods.lora.method import adapter_terms
from orchestrate.model.formulas import shape_from_dict
from orchestrate.planner.memory import estimate_memory
from orchestrate.planner.speed import estimate_speed
from orchestrate.planner.strategy import Sharding
from orchestrate.planner.terms import MethodTerms, trains_under
from orchestrate.planning import weigh
from tests.methods.lora.test_lora_plan import TINY, config
from tests.unit.planner.test_memory_model import gpu_hw, strat


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_only_zero2_3_with_cpu_optimizer_offload_and_zero3_with_the_base_on_the_cpu_train_with_offload(method):
    adapters = MethodTerms(shardings=verified_shardings(method))  # as the method's terms state them
    for verified in (Sharding("deepspeed", 3, "cpu", "cpu"), Sharding("deepspeed", 3, "cpu", "none"),
                     Sharding("deepspeed", 2, "cpu", "none")):
        assert trains_under(adapters, verified), verified
    for refused in (Sharding("deepspeed", 3, "nvme", "nvme"), Sharding("deepspeed", 3, "cpu", "nvme"),
                    Sharding("deepspeed", 3, "nvme", "none"),
                    Sharding("fsdp", 3, "cpu", "cpu"), Sharding("deepspeed", 1, "cpu", "none")):
        assert not trains_under(adapters, refused), refused


@pytest.mark.parametrize("pins,where", [({"backend": "fsdp", "offload": "cpu"}, "strategy.offload"),
                                         ({"backend": "deepspeed", "zero_stage": 1, "offload": "cpu"},
                                          "strategy.backend"),
                                         ({"zero_stage": 2, "offload": "cpu", "offload_params": True},
                                          "strategy.offload"),
                                         ({"offload": "nvme"}, "strategy.offload")])
def test_an_unverified_offload_pin_is_one_error_naming_the_offload_that_works(pins, where):
    cfg = config_from_dict({"model": {"architecture": dict(TINY)}, "strategy": pins,
                            "train": {"seq_len": 32, "global_batch_size": 2, "method": "qlora"}})
    with pytest.raises(UserError) as err:
        weigh(cfg, gpu_hw(2), shape_from_dict(dict(TINY)))
    assert [p.where for p in err.value.problems] == [where]
    assert "deepspeed zero_stage 3 with offload cpu and offload_params cpu" in err.value.problems[0].fix


def test_pinning_cpu_offload_plans_deepspeed_with_the_verified_offloads():
    cfg = config_from_dict({"model": {"architecture": dict(TINY)}, "strategy": {"offload": "cpu"},
                            "train": {"seq_len": 32, "global_batch_size": 2, "method": "qlora"}})
    plan = weigh(cfg, gpu_hw(2), shape_from_dict(dict(TINY)))
    assert {(c.strategy.backend, c.strategy.zero_stage, c.strategy.offload_optimizer, c.strategy.offload_params)
            for c in plan.candidates} == {("deepspeed", 3, "cpu", "cpu"), ("deepspeed", 3, "cpu", "none"),
                                          ("deepspeed", 2, "cpu", "none")}


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_the_offloaded_base_is_on_the_host_and_zero3_gathers_the_same_as_without_offload(method):
    shape, hw = shape_from_dict(dict(TINY)), gpu_hw(2)
    a = adapters_for(config(TINY, method=method, lora={"r": 4}), shape)
    off = estimate_memory(shape, hw, strat("deepspeed", 3, "cpu", "cpu"), 32, 1, [adapter_terms(a, shape)])
    on_gpu = estimate_memory(shape, hw, strat("deepspeed", 3), 32, 1, [adapter_terms(a, shape)])
    whole, _, _ = base_bytes(shape, a, 2)  # bf16 on a GPU; NF4 block linears for qlora
    # Per rank: the base's partition and the adapters' bf16 partition, times 2 ranks on the node.
    assert off.cpu["offloaded_params"] == int(2 * (whole / 2 + 2 * a.trainable / 2))
    assert off.gpu["weights"] == 0
    assert off.gpu["gathered_params"] == on_gpu.gpu["gathered_params"]
    assert off.gpu_total < on_gpu.gpu_total


def test_the_offloaded_base_crosses_pcie_before_every_forward_and_backward_gather():
    shape, hw = shape_from_dict(dict(TINY)), gpu_hw(2)
    a = adapters_for(config(TINY, method="qlora", lora={"r": 4}), shape)
    accumulation, c, n, t = 3, 2, 2, a.trainable
    speed = estimate_speed(shape, hw, strat("deepspeed", 3, "cpu", "cpu"), 32, accumulation, [adapter_terms(a, shape)])
    whole, _, _ = base_bytes(shape, a, c)
    # base: 2 gathers per micro-batch, up only; adapters (ZeRO-Offload): grads down every micro-batch,
    # updated values up once, their own 2 gathers per micro-batch (speed._offload).
    moved = accumulation * 2 * whole / n + accumulation * c * t / n + c * t / n + accumulation * 2 * c * t / n
    assert speed.breakdown["offload_transfer"] == pytest.approx(moved / hw.gpu.pcie_bandwidth)
    full_model = estimate_speed(shape, hw, strat("deepspeed", 3, "cpu", "cpu"), 32, accumulation)
    assert speed.breakdown["cpu_optimizer"] < full_model.breakdown["cpu_optimizer"]  # Adam on the adapters only


def test_an_offloaded_adapter_run_is_chosen_only_where_nothing_without_offload_fits():
    from orchestrate.hardware.flags import HardwareFlags
    from tests.methods.lora.test_lora_plan import LLAMA3_8B

    shape = shape_from_dict(dict(LLAMA3_8B))
    cfg = config_from_dict({"model": {"architecture": dict(LLAMA3_8B)},
                            "train": {"seq_len": 4096, "global_batch_size": 8, "method": "qlora"}})
    plan = weigh(cfg, HardwareFlags(gpus=1, gpu_mem="12GiB", cpu_mem="32GiB").resolve(), shape)
    offloaded = [c for c in plan.candidates if c.fits and c.strategy.offload_params == "cpu"]
    assert offloaded and plan.strategy.offload_params == "none"  # both fit; the verified-on-GPU-less one waits


@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_offload_moves_only_the_adapters_states_and_leaves_the_base_on_the_gpu(stage):
    shape, hw = shape_from_dict(dict(TINY)), gpu_hw(2)
    a = adapters_for(config(TINY, method="qlora", lora={"r": 4}), shape)
    off = estimate_memory(shape, hw, strat("deepspeed", stage, "cpu"), 32, 1, [adapter_terms(a, shape)])
    on_gpu = estimate_memory(shape, hw, strat("deepspeed", stage), 32, 1, [adapter_terms(a, shape)])
    t = a.trainable
    # DeepSpeed's fp32 Adam m, v and master partitions of the adapters, 2 ranks on the node (stage_1_and_2.py /
    # stage3.py with offload_optimizer: the states on the CPU)
    assert off.cpu["offloaded_optimizer"] == 2 * 8 * t // 2 and off.cpu["offloaded_master_weights"] == 2 * 4 * t // 2
    assert off.gpu["optimizer_states"] == off.gpu["master_weights"] == 0
    assert off.gpu["weights"] == on_gpu.gpu["weights"]  # the frozen base (and 16-bit adapters) stay on the GPU
    assert off.cpu["offloaded_params"] == 0
    speed = estimate_speed(shape, hw, strat("deepspeed", stage, "cpu"), 32, 1, [adapter_terms(a, shape)])
    moved = 2 * t / 2 + 2 * t / 2  # the adapters' bf16 gradients down, their update up; the base never moves
    assert speed.breakdown["offload_transfer"] == pytest.approx(moved / hw.gpu.pcie_bandwidth)


@pytest.mark.parametrize("seq_len", [1536, 1024])
def test_llama2_70b_qlora_on_2x8gib_is_planned_with_the_base_offloaded(seq_len):
    """The issue's fsdp_qlora setup (docs/lora.md): ZeRO-3 with the NF4 base and the optimizer on the
    host is chosen and predicted to fit at 1536 and 1024 tokens (with ZeRO-3 releasing each block after
    its forward, planner/ds_buckets.py). At 2048 it fits only with activation offload (test below)."""
    from pathlib import Path

    from orchestrate.config.load import load_config
    from orchestrate.hardware.flags import HardwareFlags
    from orchestrate.planning import plan_for

    example = Path(__file__).resolve().parents[3] / "examples" / "llama2-70b.yaml"
    cfg = load_config(example, [f"train.seq_len={seq_len}", "train.method=qlora", "train.optimizer.name=auto"])
    hw = HardwareFlags(gpus=2, gpu_mem="8GiB", cpu_mem="128GiB").resolve()
    plan = plan_for(cfg, hw)
    closest = plan.chosen
    assert closest is not None, plan.candidates[0].reason
    s = closest.strategy
    assert (s.backend, s.zero_stage, s.offload_optimizer, s.offload_params) == ("deepspeed", 3, "cpu", "cpu")
    assert closest.memory.cpu["offloaded_params"] > 30 * 2**30  # the NF4 base, on the host
    assert closest.memory.gpu_total <= cfg.strategy.gpu_memory_headroom * hw.gpu.memory_bytes  # the usable 7.2 GiB


def test_llama2_70b_qlora_on_2x8gib_at_2048_tokens_fits_only_with_activation_offload():
    """DeepSpeed runs activation offload (tests/unit/backends/test_memory_knobs_train.py): the 80 checkpointed block inputs
    wait in host memory, and the offloaded ZeRO-3 plan fits at 2048 tokens with 0.34 GiB to spare. Pinned
    off it is refused, 37 MiB over with every other knob on (the MLP in 2 tiles among them), with a shorter
    length and the knob to try."""
    from pathlib import Path

    from orchestrate.config.load import load_config
    from orchestrate.hardware.flags import HardwareFlags
    from orchestrate.planner.plan import Refusal
    from orchestrate.planning import plan_for, refusal_error

    example = Path(__file__).resolve().parents[3] / "examples" / "llama2-70b.yaml"
    overrides = ["train.seq_len=2048", "train.method=qlora", "train.optimizer.name=auto"]
    hw = HardwareFlags(gpus=2, gpu_mem="8GiB", cpu_mem="128GiB").resolve()
    cfg = load_config(example, overrides)
    usable = cfg.strategy.gpu_memory_headroom * hw.gpu.memory_bytes
    plan = plan_for(cfg, hw)
    assert plan.chosen.name == "deepspeed-z3-offload_opt_cpu-offload_param_cpu-bf16-ac-actoff-mb2"
    assert 0.3 * 2**30 < usable - plan.chosen.memory.gpu_total < 0.4 * 2**30
    # (splitting each sequence over both cards fits without activation offload: pinned off here)
    pinned = plan_for(load_config(example, [*overrides, "train.activation_offload=false",
                                            "train.sequence_parallel=1"]), hw)
    assert isinstance(pinned, Refusal)
    closest = pinned.candidates[0]
    # the closest: every other knob on (chunked loss, tiled MLP, fused kernels where liger-kernel is installed)
    assert closest.name.startswith("deepspeed-z3-offload_opt_cpu-offload_param_cpu-bf16-ac-")
    assert closest.name.endswith("-mb1") and not closest.strategy.activation_offload and closest.strategy.mlp_tiles
    assert 0 < closest.memory.gpu_total - usable < 0.1 * 2**30
    assert {"train.seq_len", "train.activation_offload"} <= {p.where for p in refusal_error(pinned).problems}
