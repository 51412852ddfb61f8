"""train.embedding_offload (planner/knobs.py): the frozen input embedding kept in host memory. Pure planner:
the terms against hand-computed numbers, where it is valid, the one error a pin where it is not gets, that
the search takes it only where the run does not fit otherwise, and the Llama-3-8B QLoRA plan on 1 x 8 GiB."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrate.config.load import config_from_dict
from orchestrate.errors import UserError
from orchestrate.hardware.flags import HardwareFlags
from orchestrate.methods.lora.adapters import adapters_for
from orchestrate.methods.lora.method import adapter_terms
from orchestrate.model.formulas import shape_from_dict
from orchestrate.planner.allocator_reserve import reserve_bytes
from orchestrate.planner.memory import estimate_memory
from orchestrate.planner.plan import RunPlan
from orchestrate.planner.search import Limits
from orchestrate.planner.speed import estimate_speed
from orchestrate.planner.strategy import Strategy
from orchestrate.planning import weigh
from tests.helpers.plans import TINY_GPT2
from tests.methods.lora.test_lora_plan import LLAMA3_8B, TINY
from tests.unit.planner.test_memory_model import cpu_hw, strat

GiB = 2**30
TABLE = 128256 * 4096 * 2  # Llama-3-8B's input embedding in bf16
ROWS = 4096 * 4096 * 2  # one sample of 4096 tokens looked up, bf16


def cfg(arch: dict, seq: int = 4096, batch: int = 8, **train) -> object:
    return config_from_dict({"model": {"architecture": dict(arch)},
                             "train": {"seq_len": seq, "global_batch_size": batch, **train}})


def gpus(mem: str = "8GiB", n: int = 1):
    return HardwareFlags(gpus=n, gpu_mem=mem, cpu_mem="32GiB").resolve()


def test_the_table_leaves_the_gpu_weights_and_each_rank_keeps_a_host_copy():
    shape, hw = shape_from_dict(dict(LLAMA3_8B)), gpus(n=2)
    a = adapters_for(cfg(LLAMA3_8B, method="qlora"), shape)
    off = replace(strat("ddp", 0, ac=True), loss_chunks=16)
    on = replace(off, embedding_offload=True)
    m_off, m_on = estimate_memory(shape, hw, off, 4096, 1, [adapter_terms(a, shape)]), estimate_memory(shape, hw, on, 4096, 1, [adapter_terms(a, shape)])
    assert m_off.gpu["weights"] - m_on.gpu["weights"] == TABLE
    # the allocator reserve is a fraction of what is accounted (the table is a state), so it shrinks with the table
    reserve = reserve_bytes("ddp", hw.expandable_segments, TABLE, TABLE) - reserve_bytes("ddp", hw.expandable_segments, 0, 0)
    assert m_off.gpu_total - m_on.gpu_total == pytest.approx(TABLE + reserve, abs=2)
    assert m_on.cpu["offloaded_embedding"] == 2 * (TABLE + ROWS) and m_off.cpu["offloaded_embedding"] == 0


def test_the_rows_cross_pcie_once_per_micro_batch_not_overlapped():
    shape, hw = shape_from_dict(dict(LLAMA3_8B)), gpus()
    off = strat("ddp", 0, ac=True)
    on = replace(off, embedding_offload=True)
    s_off, s_on = estimate_speed(shape, hw, off, 4096, 8), estimate_speed(shape, hw, on, 4096, 8)
    copy = 8 * ROWS / hw.gpu.pcie_bandwidth
    assert s_on.breakdown["offload_transfer"] - s_off.breakdown["offload_transfer"] == pytest.approx(copy)
    assert s_on.step_time_s - s_off.step_time_s == pytest.approx(copy)
    assert copy < 0.01 * s_on.step_time_s  # 32 MiB per sample against seconds of compute


def test_llama3_8b_qlora_on_one_8gib_card_fits_at_seq_3072_with_the_embedding_in_host_memory():
    shape, hw = shape_from_dict(dict(LLAMA3_8B)), gpus()
    config = cfg(LLAMA3_8B, seq=3072, method="qlora", optimizer={"name": "auto"})
    plan = weigh(config, hw, shape)
    assert isinstance(plan, RunPlan)
    chosen = plan.chosen
    assert chosen.name == "ddp-bf16-ac-actoff-embcpu-ce12-adamw8bit-mb1"
    usable = Limits.of(config, hw).gpu
    assert usable == 7_730_941_132  # 0.9 x 8 GiB
    # the allocator reserve is the replay-fitted one of DDP with expandable segments (orchestrate's setting)
    assert chosen.memory.gpu_total == 7_712_810_024  # 7.18 GiB
    assert usable - chosen.memory.gpu_total == 18_131_108  # 17 MiB to spare, with 8-bit AdamW states
    # pinned off, ZeRO-3 with the NF4 base and the adapters' optimizer on the host fits once DeepSpeed chunks
    # the loss (it was 0.33 GiB over unchunked); ranked after the DDP plan above where both fit (no GPU has
    # run the offload)
    pinned = weigh(cfg(LLAMA3_8B, seq=3072, method="qlora", optimizer={"name": "auto"}, embedding_offload=False),
                   hw, shape)
    assert isinstance(pinned, RunPlan)
    assert pinned.chosen.name == "deepspeed-z3-offload_opt_cpu-offload_param_cpu-bf16-ac-ce12-mb2"
    assert usable - pinned.chosen.memory.gpu_total == 1_499_818_607


def test_taken_only_where_nothing_fits_without_it():
    shape = shape_from_dict(dict(LLAMA3_8B))
    roomy = weigh(cfg(LLAMA3_8B, method="qlora"), gpus("24GiB"), shape).strategy
    assert not roomy.embedding_offload and not roomy.activation_offload
    tight = weigh(cfg(LLAMA3_8B, seq=2048, method="qlora"), gpus(), shape).strategy
    assert tight.embedding_offload and tight.backend == "ddp"
    # full fine-tuning trains the embedding: never offloaded, whatever fits
    full = weigh(cfg(LLAMA3_8B, seq=512), gpus("80GiB"), shape)
    assert not any(c.strategy.embedding_offload for c in full.candidates)


def test_never_tried_where_it_cannot_run():
    tied = {**TINY_GPT2}
    for arch, hw, method in ((tied, gpus(), "lora"), (TINY, cpu_hw(2), "qlora")):
        plan = weigh(cfg(arch, seq=32, batch=2, method=method), hw, shape_from_dict(dict(arch)))
        assert not any(c.strategy.embedding_offload for c in plan.candidates)
    plan = weigh(cfg(LLAMA3_8B, method="qlora"), gpus(), shape_from_dict(dict(LLAMA3_8B)))
    assert {c.strategy.backend for c in plan.candidates if c.strategy.embedding_offload} == {"ddp"}


@pytest.mark.parametrize("arch,method,hw,extra,message,fix", [
    (LLAMA3_8B, "full", "gpu", {}, "full fine-tuning trains it", "train.method: lora or qlora"),
    (TINY_GPT2, "lora", "gpu", {}, "tied to the LM head", "embedding_offload: false"),
    (TINY, "qlora", "cpu", {}, "this profile has none", "embedding_offload: false"),
    (LLAMA3_8B, "qlora", "gpu", {"strategy": {"backend": "fsdp"}}, "not verified to run under fsdp", "backend ddp"),
])
def test_pinned_where_it_cannot_run_is_one_error_naming_what_works(arch, method, hw, extra, message, fix):
    data = {"model": {"architecture": dict(arch)},
            "train": {"seq_len": 32, "global_batch_size": 2, "method": method, "embedding_offload": True}, **extra}
    with pytest.raises(UserError) as err:
        weigh(config_from_dict(data), gpus() if hw == "gpu" else cpu_hw(2), shape_from_dict(dict(arch)))
    found = [p for p in err.value.problems if p.where == "train.embedding_offload"]
    assert len(found) == 1 and message in found[0].message and fix in found[0].fix, err.value.problems


def test_pinned_off_where_it_would_fit_is_a_remedy():
    from orchestrate.planning import refusal_error

    plan = weigh(cfg(LLAMA3_8B, seq=3072, method="qlora", optimizer={"name": "auto"}, embedding_offload=False),
                 gpus(), shape_from_dict(dict(LLAMA3_8B)))
    remedies = {p.where: p for p in refusal_error(plan).problems}
    assert remedies["train.embedding_offload"].fix == "train.embedding_offload: auto"
    assert "-embcpu-" in remedies["train.embedding_offload"].message


def test_the_strategy_round_trips_through_plan_json_and_older_plans_read_as_off():
    s = replace(strat("ddp", 0, ac=True), embedding_offload=True)
    assert s.name == "ddp-bf16-ac-embcpu-mb1"
    assert Strategy.from_dict(s.to_dict()) == s
    older = {key: v for key, v in s.to_dict().items() if key != "embedding_offload"}
    assert Strategy.from_dict(older).embedding_offload is False


def test_ddp_json_says_so():
    from orchestrate.backends.ddp import ddp_settings

    plan = weigh(cfg(LLAMA3_8B, seq=2048, method="qlora"), gpus(), shape_from_dict(dict(LLAMA3_8B)))
    settings = ddp_settings(plan)
    assert settings["embedding_offload"] is True
    assert any("input embedding" in step for step in settings["steps"])
