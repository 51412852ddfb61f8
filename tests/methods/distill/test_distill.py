"""Distillation, the pure and single-process parts: the `distill:` section, the teacher's memory
and speed terms per placement against hand-computed numbers, the planner placing a teacher that
does not fit beside the student, the tokenizer / vocabulary check, the loss against its formula,
and the frozen teacher."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from orchestrate.config.load import config_from_dict
from orchestrate.errors import UserError
from orchestrate.methods.distill.memory import (
    SOFT_TARGET_BYTES_PER_TOKEN_VOCAB,
    STUDENT_SOFT_BYTES_PER_TOKEN_VOCAB,
    TOPK_BYTES_PER_ENTRY,
    teacher_model,
)
from orchestrate.methods.distill.method import distill_terms
from orchestrate.methods.distill.objective import DistillationObjective, soft_target_kl
from orchestrate.model.formulas import shape_from_dict
from orchestrate.planner.allocator_reserve import RESERVE
from orchestrate.planner.auxiliary import (
    AuxiliaryModel,
    auto_placements,
    first_pass_bytes,
    forward_flops_per_token,
    resolve_placement,
)
from orchestrate.planner.memory import estimate_memory
from orchestrate.planner.nccl_buffers import nccl_buffer_bytes
from orchestrate.planner.plan import Refusal, RunPlan
from orchestrate.planner.speed import estimate_speed, training_flops_per_token
from orchestrate.planning import weigh
from orchestrate.worker.objective import CausalLMObjective
from tests.helpers.word_tokenizers import word_tokenizer
from tests.unit.planner.test_memory_model import cpu_hw, gpu_hw, strat

GPT2 = {"model_type": "gpt2", "n_embd": 96, "n_layer": 3, "n_head": 4, "n_positions": 64, "vocab_size": 257}
STUDENT = {**GPT2, "n_embd": 32, "n_layer": 1, "n_head": 2}
LLAMA_7B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096}
SEQ, MICRO = 32, 2


def _config(distill: dict | None = None, arch: dict = STUDENT, **train):
    data = {"model": {"architecture": dict(arch)},
            "train": {"seq_len": SEQ, "global_batch_size": 4, **train}}
    if distill is not None:
        data["distill"] = distill
    return config_from_dict(data)


def _teacher(placement: str, top_k: int = 16) -> AuxiliaryModel:
    return teacher_model(shape_from_dict(dict(GPT2)), placement, top_k)


def test_distill_section_defaults_and_bounds():
    d = _config({"teacher": "t"}).distill
    assert (d.temperature, d.alpha, d.placement, d.top_k) == (2.0, 0.5, "auto", 64)
    assert _config().distill is None
    for bad in ({"teacher": "t", "alpha": 1.5}, {"teacher": "t", "temperature": 0}, {"teacher": "t", "placement": "gpu"},
                {"teacher": "t", "top_k": 0}, {"temperature": 2.0}):
        with pytest.raises(UserError):
            _config(bad)


def test_auto_tries_the_placements_this_hardware_has_cheapest_first():
    assert auto_placements(gpu_hw(2)) == ["replicated", "sharded", "offload", "precomputed"]
    assert auto_placements(gpu_hw(1)) == ["replicated", "offload", "precomputed"]
    assert auto_placements(cpu_hw(2)) == ["replicated", "sharded", "precomputed"]


def test_a_hand_pinned_plan_resolves_auto_like_the_student_s_parameters():
    assert resolve_placement("auto", strat("ddp", 0), 2) == "replicated"
    assert resolve_placement("auto", strat("deepspeed", 2), 2) == "replicated"
    assert resolve_placement("auto", strat("fsdp", 3), 2) == "sharded"
    assert resolve_placement("auto", strat("deepspeed", 3), 1) == "replicated"
    assert resolve_placement("precomputed", strat("fsdp", 3), 2) == "precomputed"


@pytest.mark.parametrize("placement", ["replicated", "sharded", "offload", "precomputed"])
def test_teacher_memory_per_placement_is_hand_computed(placement):
    t, hw, s = _teacher(placement), gpu_hw(2), strat("deepspeed", 3, micro=MICRO)
    p, v, c, n = t.shape.parameters, t.shape.vocab_size, 2, 2
    gathered = c * min(p, p - t.shape.num_layers * t.shape.block_parameters + 2 * t.shape.block_parameters)
    full_logits = MICRO * SEQ * v * (c + SOFT_TARGET_BYTES_PER_TOKEN_VOCAB)
    want = {"replicated": (c * p, 0, full_logits, 0), "sharded": (c * p // n, gathered, full_logits, 0),
            "offload": (0, gathered, full_logits, c * p // n),
            "precomputed": (0, 0, MICRO * SEQ * (16 * TOPK_BYTES_PER_ENTRY + v * STUDENT_SOFT_BYTES_PER_TOKEN_VOCAB), 0)
            }[placement]
    with_teacher = estimate_memory(t.shape, hw, s, SEQ, 1, [distill_terms(t)])
    without = estimate_memory(t.shape, hw, s, SEQ, 1)
    got = (with_teacher.gpu["teacher_weights"], with_teacher.gpu["teacher_gathered"],
           with_teacher.gpu["teacher_logits"], with_teacher.cpu["offloaded_teacher"] // hw.ranks_per_node)
    assert got == want
    assert "teacher_weights" not in without.gpu  # runs without a teacher keep their breakdown
    # Everything else is unchanged: the teacher adds exactly its own terms (allocator reserve aside,
    # the fraction of transient bytes of what is not a state: a frozen teacher's weights included).
    extra = sum(want[:3])
    _, _, fraction = RESERVE["deepspeed"][hw.expandable_segments]
    assert with_teacher.gpu["weights"] == without.gpu["weights"]
    assert with_teacher.gpu_total - without.gpu_total == pytest.approx(extra * (1 + fraction), rel=0.001, abs=2)


def test_offload_on_a_cpu_only_machine_counts_the_teacher_in_the_rank_s_memory():
    t, s = _teacher("offload"), strat("fsdp", 3, precision="fp32", micro=MICRO)
    mem = estimate_memory(t.shape, cpu_hw(2), s, SEQ, 1, [distill_terms(t)])
    assert mem.gpu["teacher_weights"] == 4 * t.shape.parameters and mem.cpu["offloaded_teacher"] == 0


def test_speed_adds_the_teacher_forward_and_its_gathers():
    t_shape, hw = shape_from_dict(dict(GPT2)), gpu_hw(2)
    s = strat("fsdp", 3, micro=MICRO)
    base = estimate_speed(t_shape, hw, s, SEQ, 2)
    replicated = estimate_speed(t_shape, hw, s, SEQ, 2, [distill_terms(_teacher("replicated"))])
    sharded = estimate_speed(t_shape, hw, s, SEQ, 2, [distill_terms(_teacher("sharded"))])
    precomputed = estimate_speed(t_shape, hw, s, SEQ, 2, [distill_terms(_teacher("precomputed"))])
    # Teacher and student of one shape: its forward is forward/(forward+backward) of the compute.
    ratio = forward_flops_per_token(t_shape, SEQ) / training_flops_per_token(t_shape, SEQ)[0]
    assert ratio == pytest.approx(1 / 3)
    assert replicated.breakdown["teacher_forward"] == pytest.approx(base.breakdown["compute"] * ratio)
    assert replicated.breakdown["teacher_communication"] == 0 < sharded.breakdown["teacher_communication"]
    assert precomputed.step_time_s == base.step_time_s < replicated.step_time_s


def test_planner_precomputes_a_teacher_that_does_not_fit_beside_the_student():
    # A 7B teacher in bf16 is 13.5 GB: it fits on no 8 GB card, alone or sharded over two; its
    # precomputed top-k logits do (and its shards offloaded to the CPU RAM, where there is room).
    student, teacher = shape_from_dict(dict(STUDENT)), shape_from_dict(dict(LLAMA_7B))
    hw = gpu_hw(2)
    for placement in ("replicated", "sharded"):
        plan = weigh(_config({"teacher": "t", "placement": placement}), hw, student, {"teacher": teacher})
        assert isinstance(plan, Refusal), placement
    plan = weigh(_config({"teacher": "t", "placement": "precomputed"}), hw, student, {"teacher": teacher})
    assert isinstance(plan, RunPlan) and plan.chosen.memory.gpu["teacher_weights"] == 0
    assert plan.chosen.memory.gpu["teacher_logits"] < 64 * 2**20  # top-k entries + the student's soft targets
    # Its first pass holds the gathered root and two blocks of the offloaded 7B (1.3 GB) before the
    # student exists: the rank's peak is that pass, not the tiny student's training.
    gpu = plan.chosen.memory.gpu
    pass_bytes = first_pass_bytes(teacher_model(teacher, "precomputed", 64), plan.strategy, hw, SEQ, 2)
    assert pass_bytes > 2**30
    training = sum(v for k, v in gpu.items() if k not in ("teacher_first_pass", "cuda_context", "workspace",
                                                              "allocator_reserve", "nccl_buffers"))
    assert gpu["nccl_buffers"] == nccl_buffer_bytes(hw)  # added after the first pass
    assert gpu["teacher_first_pass"] == pytest.approx(pass_bytes - training, abs=2)
    # auto: every candidate takes the first placement that fits. With 64 GiB of RAM the offloaded
    # shards (6.7 GB per rank) fit; with 12 GiB (two ranks' 4 GiB runtimes beside them) only the
    # precomputed logits do.
    assert weigh(_config({"teacher": "t"}), hw, student, {"teacher": teacher}).chosen.placements["teacher"] == "offload"
    auto = weigh(_config({"teacher": "t"}), gpu_hw(2, ram_gib=12), student, {"teacher": teacher})
    assert auto.chosen.placements["teacher"] == "precomputed"
    assert auto.chosen.memory.gpu == plan.chosen.memory.gpu
    assert {c.placements["teacher"] for c in auto.candidates} == {"precomputed"}
    # a small teacher fits replicated beside the student: the cheapest placement per step.
    small = weigh(_config({"teacher": "t"}), hw, student, {"teacher": shape_from_dict(dict(GPT2))})
    assert small.chosen.placements["teacher"] == "replicated"

    assert RunPlan.model_validate(small.to_dict()).chosen.placements["teacher"] == "replicated"


def _teacher_dir(path: Path, vocab: int, tokenizer_words: list[str] | None) -> Path:
    from transformers import GPT2Config

    from orchestrate.data.tokenizer import save_tokenizer

    GPT2Config(**{**GPT2, "vocab_size": vocab}).save_pretrained(path)
    if tokenizer_words is None:
        save_tokenizer(None, path)  # the byte tokenizer, as orchestrate saves it next to a run's model
    else:
        word_tokenizer(path, tokenizer_words)
    return path


def test_a_teacher_with_the_student_s_tokenizer_plans_with_its_terms(tmp_path):
    from orchestrate.planning import plan_for

    teacher = _teacher_dir(tmp_path / "teacher", 257, None)
    plan = plan_for(_config({"teacher": str(teacher)}), cpu_hw(2))
    assert plan.chosen.memory.gpu["teacher_logits"] > 0
    assert plan.chosen.speed.breakdown["teacher_forward"] > 0


def test_teacher_and_student_tokenizers_that_differ_are_one_error_with_paths_and_fixes(tmp_path):
    from orchestrate.planning import plan_for

    teacher = _teacher_dir(tmp_path / "teacher", 300, ["the", "cat"])
    with pytest.raises(UserError) as err:
        plan_for(_config({"teacher": str(teacher)}), cpu_hw(2))
    where = [p.where for p in err.value.problems]
    assert where == ["distill.teacher", "data.tokenizer (null: the built-in byte tokenizer)"], err.value.problems
    assert all(p.fix for p in err.value.problems) and "300" in err.value.problems[0].message
    import yaml

    from orchestrate.api import plan_from_file

    path = tmp_path / "distill.yaml"  # `orchestrate plan` checks it too
    path.write_text(yaml.safe_dump({"model": {"architecture": STUDENT}, "train": {"seq_len": SEQ, "global_batch_size": 4},
                                    "distill": {"teacher": "teacher"}}))
    with pytest.raises(UserError, match="do not share a tokenizer"):
        plan_from_file(path, (), cpu_hw(2))
    with pytest.raises(UserError, match="not a model directory"):
        plan_for(_config({"teacher": str(tmp_path / "missing")}), cpu_hw(2))


def test_distillation_of_another_task_is_refused_with_its_path(tmp_path):
    from orchestrate.methods.distill.teacher import teacher_shape

    config = config_from_dict({"model": {"architecture": {"model_type": "bert", "hidden_size": 32,
                                                           "num_hidden_layers": 1, "num_attention_heads": 2,
                                                           "intermediate_size": 64, "vocab_size": 257},
                                         "task": "masked-lm"},
                               "train": {"seq_len": SEQ, "global_batch_size": 4}, "data": {"packing": False},
                               "distill": {"teacher": str(tmp_path)}})
    with pytest.raises(UserError) as err:
        teacher_shape(config, shape_from_dict(dict(STUDENT)))
    assert [p.where for p in err.value.problems] == ["distill"] and "causal-lm" in err.value.problems[0].fix


def test_soft_target_kl_is_the_kl_of_the_softened_distributions():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    T = 2.0
    p, q = torch.softmax(teacher / T, -1), torch.softmax(student / T, -1)
    by_hand = (p * (p.log() - q.log())).sum(-1).mean()
    assert soft_target_kl(student, teacher, None, T, None) == pytest.approx(by_hand.item(), rel=1e-5)
    assert soft_target_kl(teacher, teacher, None, T, None).item() == pytest.approx(0.0, abs=1e-6)
    top = teacher.topk(11, dim=-1)  # k = vocabulary: the top-k form is the full KL
    assert soft_target_kl(student, top.values, top.indices, T, None) == pytest.approx(by_hand.item(), rel=1e-5)
    mask = torch.ones(2, 5)
    mask[1] = 0  # only the first sequence counts
    first = (p[0] * (p[0].log() - q[0].log())).sum(-1).mean()
    assert soft_target_kl(student, teacher, None, T, mask) == pytest.approx(first.item(), rel=1e-5)


def test_the_objective_is_alpha_ce_plus_t_squared_kl_and_evaluates_the_student_alone():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    student = GPT2LMHeadModel(GPT2Config(**STUDENT)).eval()
    teacher = GPT2LMHeadModel(GPT2Config(**GPT2)).eval()
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    settings = _config({"teacher": "t", "alpha": 0.3, "temperature": 3.0}).distill
    objective = DistillationObjective(CausalLMObjective(), lambda b: (teacher(input_ids=b["input_ids"]).logits, None),
                                      settings)
    with torch.no_grad():
        out, t_logits = student(**batch), teacher(input_ids=ids).logits
        want = 0.3 * out.loss + 0.7 * 9.0 * soft_target_kl(out.logits, t_logits, None, 3.0, None)
        assert objective.loss(student, batch).item() == pytest.approx(want.item(), rel=1e-6)
        sums = objective.eval_sums(student, batch)  # the task's sums of the student alone
        assert sums["loss"] == pytest.approx(out.loss.item(), rel=1e-6)
        assert sums == pytest.approx(CausalLMObjective().eval_sums(student, batch), rel=1e-6)
    assert not math.isclose(want.item(), out.loss.item())


def test_the_teacher_is_frozen_in_eval_mode(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from orchestrate.methods.distill.runtime import build_teacher, teacher_placement
    from tests.helpers.plans import make_plan as pinned_plan

    GPT2LMHeadModel(GPT2Config(**GPT2)).save_pretrained(tmp_path / "teacher")
    plan = pinned_plan(strat("fsdp", 3, precision="fp32", micro=2), ranks=1,
                       config={"distill": {"teacher": str(tmp_path / "teacher"), "placement": "offload"}})
    cpu = torch.device("cpu")
    assert teacher_placement(plan, cpu, 1) == "replicated"  # offload on a CPU worker: host memory already
    teacher = build_teacher(plan, cpu, 1, "replicated")
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert sum(p.numel() for p in teacher.parameters()) == shape_from_dict(dict(GPT2)).parameters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_target_constants_are_the_loss_s_measured_peak(dtype):
    from orchestrate.simulate.counter import LiveStorageCounter

    b, s, v, k = 2, 64, 4096, 16
    student = torch.randn(b, s, v, dtype=dtype, requires_grad=True)
    teacher = torch.randn(b, s, v, dtype=dtype)
    values, ids = torch.randn(b, s, k), torch.randint(0, v, (b, s, k))
    peaks = []
    for t_logits, t_ids in ((teacher, None), (values, ids)):
        counter = LiveStorageCounter()  # counts what the loss allocates; its inputs were made before
        with counter:
            soft_target_kl(student, t_logits, t_ids, 2.0, None).backward()
        peaks.append(counter.peak)
        student.grad = None
    assert peaks[0] == pytest.approx(SOFT_TARGET_BYTES_PER_TOKEN_VOCAB * b * s * v, rel=0.01)
    cached = values.nbytes + ids.nbytes  # the micro-batch's cache entries, on the device
    predicted = b * s * (v * STUDENT_SOFT_BYTES_PER_TOKEN_VOCAB + k * TOPK_BYTES_PER_ENTRY)
    assert peaks[1] + cached == pytest.approx(predicted, rel=0.02)
