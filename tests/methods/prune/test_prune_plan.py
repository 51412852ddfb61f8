"""Pruning's config, its sparsity schedule, the plan-time checks and the planner's mask and saved-size
terms, without torch."""

from __future__ import annotations

import pytest

from orchestrate.config.load import config_from_dict, load_config
from orchestrate.errors import UserError
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.methods.prune.method import mask_terms
from orchestrate.methods.prune.schedule import (
    pruned_count,
    pruned_parameters,
    scheduled_sparsity,
    sparsity_at,
    updates_mask,
)
from orchestrate.model.meta import load_model_config, shape_from_config
from orchestrate.planner.memory import estimate_memory
from orchestrate.planner.plan import RunPlan
from orchestrate.planner.strategy import Strategy
from orchestrate.planning import weigh

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 257, "max_position_embeddings": 64}
TINY_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64, "vocab_size": 257}


def _config(prune: dict, arch: dict = TINY_LLAMA, **train):
    return config_from_dict({"model": {"architecture": dict(arch)},
                             "train": {"seq_len": 32, "global_batch_size": 8, "max_steps": 20, **train},
                             "prune": prune})


def _prune(**over):
    return {"method": "magnitude", "target_sparsity": 0.5, "schedule": {"start_step": 2, "end_step": 10,
                                                                        "every": 2}, **over}


def _shape(cfg):
    return shape_from_config(load_model_config(cfg), task=cfg.model.task)


def _cpu(ranks: int = 2) -> HardwareProfile:
    return HardwareProfile(name="cpu-test", gpus_per_node=0, cpu_processes=ranks, cpu_memory_bytes=16 * 2**30,
                           cpu_cores=2)


def test_cubic_schedule_of_zhu_and_gupta():
    prune = _config(_prune()).prune
    # s_t = s_f (1 - (1 - (t - t0)/(n dt))^3), t0 = 2, n dt = 8, s_f = 0.5
    assert [sparsity_at(t, prune) for t in (0, 2, 4, 6, 10, 15)] == pytest.approx(
        [0, 0, 0.5 * (1 - 0.75 ** 3), 0.5 * (1 - 0.5 ** 3), 0.5, 0.5])
    assert [t for t in range(21) if updates_mask(t, prune)] == [4, 6, 8, 10]
    odd = _config(_prune(schedule={"start_step": 0, "end_step": 7, "every": 3})).prune
    assert [t for t in range(21) if updates_mask(t, odd)] == [3, 6, 7], "end_step is always an update"
    # The masks' sparsity holds s_t of the last update: 0 until step 4, s_4 on step 5, s_f from 10.
    assert [scheduled_sparsity(t, prune) for t in (3, 4, 5, 9, 10, 30)] == pytest.approx(
        [0, sparsity_at(4, prune), sparsity_at(4, prune), sparsity_at(8, prune), 0.5, 0.5])
    assert [scheduled_sparsity(t, odd) for t in (2, 3, 5, 6, 7)] == pytest.approx(
        [0, sparsity_at(3, odd), sparsity_at(3, odd), sparsity_at(6, odd), 0.5])
    assert pruned_count(0.5, 7) == 3 and pruned_count(0.999, 10) == 9


def test_bad_values_are_user_errors_with_yaml_paths(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("model:\n  architecture: {model_type: llama, hidden_size: 64, num_hidden_layers: 2, "
                    "num_attention_heads: 4, intermediate_size: 128}\ntrain: {seq_len: 32, global_batch_size: 8}\n"
                    "prune:\n  target_sparsity: 1.0\n  method: lottery\n"
                    "  schedule: {start_step: 5, end_step: 5}\n")
    with pytest.raises(UserError) as err:
        load_config(path)
    where = {p.where.split(" ")[0]: p for p in err.value.problems}
    assert {"prune.target_sparsity", "prune.method", "prune.schedule"} <= set(where), where
    assert "< 1" in where["prune.target_sparsity"].fix
    assert "end_step" in where["prune.schedule"].message


def test_plan_time_checks_list_every_problem_with_a_fix():
    cfg = _config(_prune(method="structured", scope="global", schedule={"end_step": 30}), arch=TINY_GPT2)
    with pytest.raises(UserError) as err:
        weigh(cfg, _cpu(), _shape(cfg))
    problems = {p.where: p for p in err.value.problems}
    assert set(problems) == {"prune.schedule.end_step", "prune.method", "prune.scope"}, problems
    assert "max_steps (20)" in problems["prune.schedule.end_step"].message
    assert "gpt2" in problems["prune.method"].message and "magnitude" in problems["prune.method"].fix
    assert all(p.fix for p in problems.values())
    lora = _config(_prune(), method="lora")
    with pytest.raises(UserError, match="pruning settings") as err:
        weigh(lora, _cpu(), _shape(lora))
    assert [p.where for p in err.value.problems] == ["train.method"]


def test_mask_memory_is_sharded_with_the_parameters():
    cfg = _config(_prune())
    shape, prune = _shape(cfg), cfg.prune
    h, i, kv = 64, 128, 2 * 16
    elements = 2 * (h * h + 2 * h * kv + h * h + 3 * h * i)  # q, k, v, o, gate, up, down per block
    ddp = estimate_memory(shape, _cpu(), Strategy("ddp", 0, "none", "none", "fp32", False, 2), 32, 1, [mask_terms(prune, shape)])
    fsdp = estimate_memory(shape, _cpu(), Strategy("fsdp", 3, "none", "none", "fp32", False, 2), 32, 1, [mask_terms(prune, shape)])
    zero2 = estimate_memory(shape, _cpu(), Strategy("deepspeed", 2, "none", "none", "fp32", False, 2), 32, 1,
                            [mask_terms(prune, shape)])
    zero3 = estimate_memory(shape, _cpu(), Strategy("deepspeed", 3, "none", "none", "fp32", False, 2), 32, 1,
                            [mask_terms(prune, shape)])
    assert ddp.gpu["prune_masks"] == zero2.gpu["prune_masks"] == elements  # one bool byte each, replicated
    assert fsdp.gpu["prune_masks"] == zero3.gpu["prune_masks"] == elements // 2
    assert ddp.gpu["prune_scratch"] == 5 * h * i
    plain = estimate_memory(shape, _cpu(), Strategy("ddp", 0, "none", "none", "fp32", False, 2), 32)
    assert ddp.gpu_total - plain.gpu_total == elements + 5 * h * i
    structured = _config(_prune(method="structured", scope="per-layer")).prune
    s = estimate_memory(shape, _cpu(), Strategy("ddp", 0, "none", "none", "fp32", False, 2), 32, 1, [mask_terms(structured, shape)])
    assert s.gpu["prune_masks"] == 2 * 3 * h * i


def test_structured_prediction_counts_the_removed_channels():
    cfg = _config(_prune(method="structured", scope="per-layer", target_sparsity=0.25))
    shape = _shape(cfg)
    assert pruned_parameters(shape, cfg.prune) == shape.parameters - 2 * 3 * 64 * 32  # 32 of 128 channels
    magnitude = _config(_prune()).prune
    assert pruned_parameters(shape, magnitude) == shape.parameters
    plan = weigh(cfg, _cpu(), shape)
    assert isinstance(plan, RunPlan) and plan.chosen.memory.gpu["prune_masks"] > 0


def test_plan_report_states_the_saved_size():
    from orchestrate.planner.report import plan_json, render_plan
    from orchestrate.planning import method_reports

    cfg = _config(_prune(method="structured", scope="per-layer", target_sparsity=0.25))
    plan = weigh(cfg, _cpu(), _shape(cfg))
    summary = plan_json(plan, method_reports(plan))["prune"]
    assert summary["saved_intermediate_size"] == 96
    assert summary["saved_parameters"] == pruned_parameters(plan.shape, cfg.prune)
    assert summary["pruned_weights"] == 2 * 3 * 64 * 128
    assert any("pruning (structured, per-layer)" in str(p) for p in render_plan(plan, method_reports(plan)).renderables)


def test_head_pruning_counts_and_checks():
    cfg = _config(_prune(method="structured", scope="per-layer", heads=True))
    shape = _shape(cfg)
    # 64 of 128 channels (3 x 64 weights each) and 1 of 2 query heads per kv group (2 x 64 x 16 each), 2 blocks
    assert pruned_parameters(shape, cfg.prune) == shape.parameters - 2 * (3 * 64 * 64 + 2 * (2 * 64 * 16))
    ddp = estimate_memory(shape, _cpu(), Strategy("ddp", 0, "none", "none", "fp32", False, 2), 32, 1, [mask_terms(cfg.prune, shape)])
    assert ddp.gpu["prune_masks"] == 2 * (3 * 64 * 128 + 2 * 64 * 64)  # the MLP's and q/o_proj's masks
    qwen = _config(_prune(method="structured", scope="per-layer", heads=True), arch={**TINY_LLAMA, "model_type": "qwen2"})
    # qwen2's q_proj has a bias: d more per head
    assert pruned_parameters(_shape(qwen), qwen.prune) == _shape(qwen).parameters - 2 * (3 * 64 * 64 + 2 * (2 * 64 * 16 + 16))
    bad = _config(_prune(heads=True), arch={**TINY_LLAMA, "num_key_value_heads": 4})
    with pytest.raises(UserError) as err:
        weigh(bad, _cpu(), _shape(bad))
    assert [p.where for p in err.value.problems] == ["prune.heads"] and "structured" in err.value.problems[0].fix
    mha = _config(_prune(method="structured", scope="per-layer", heads=True), arch={**TINY_LLAMA, "num_key_value_heads": 4})
    with pytest.raises(UserError) as err:
        weigh(mha, _cpu(), _shape(mha))
    assert [p.where for p in err.value.problems] == ["prune.heads"] and "grouped-query" in err.value.problems[0].message
