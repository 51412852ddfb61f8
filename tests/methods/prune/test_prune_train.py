"""Pruning on 2 gloo ranks: under DDP, FSDP2, ZeRO-2 and ZeRO-3 the pruned weights
stay zero after every optimizer step (in the fp32 master copy too), masks only grow, the saved model
has the target sparsity, the loss recovers after the schedule, resuming mid-schedule is bit-exact;
structured pruning saves a smaller model whose parameter count is the plan's prediction."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from orchestrate.methods.prune.schedule import prunable_linears, pruned_parameters
from orchestrate.planner.strategy import Strategy
from tests.helpers.plans import make_plan

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 257, "max_position_embeddings": 64}
STEPS, RESUME_AT, END = 12, 5, 8
TARGET = 0.5


def _plan(strategy: Strategy, prune: dict):
    return make_plan(strategy, config={
        "model": {"architecture": dict(TINY_LLAMA)},
        "train": {"max_steps": STEPS, "optimizer": {"lr": 1e-2, "weight_decay": 0.0}, "schedule": {"warmup_steps": 1}},
        "prune": {"target_sparsity": TARGET, "schedule": {"start_step": 2, "end_step": END, "every": 2}, **prune}})


def _batches(plan, rank: int, step: int):
    """Two fixed batches per rank, alternating, from 16 of the 257 ids: a few steps learn them."""
    seq, micro = plan.config.train.seq_len, plan.strategy.micro_batch_size
    out = []
    for i in range(plan.chosen.gradient_accumulation):
        ids = torch.randint(0, 16, (micro, seq), generator=torch.Generator().manual_seed(1000 * rank + 10 * (step % 2) + i))
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _master_sparsity(engine, views) -> float | None:
    """The share of zeros in DeepSpeed's fp32 master copy of the pruned weights (None elsewhere: the
    optimizer steps the parameter itself)."""
    from deepspeed.utils import safe_get_full_fp32_param

    from orchestrate.methods.prune.masks import unwrap

    if not hasattr(engine, "engine"):
        return None
    module = unwrap(engine.model)
    params = dict(module.named_parameters())
    zeros = total = 0
    for v in views:
        full = safe_get_full_fp32_param(params[v.name])  # collective
        zeros, total = zeros + int((full == 0).sum()), total + full.numel()
    return zeros / total


def _run(training, steps: range, ckpt: Path | None = None) -> dict:
    """The pruning callback around each step, as the loop calls it (data, checkpointer and stop unused)."""
    from orchestrate.methods.prune.callback import Pruning
    from orchestrate.worker.callbacks.base import StepEnd

    engine, plan, info = training.engine, training.plan, training
    cb = Pruning()
    cb.on_train_start(info)
    out: dict = {"loss": [], "sparsity": [], "master": [], "monotone": True}
    for step in steps:
        loss = engine.train_step(_batches(plan, info.rank.rank, step)).loss
        before = cb.masks
        end = StepEnd(step, step == STEPS, False, {})
        cb.on_step_end(info, end)
        if before is not None and cb.masks is not before:  # kept weights only ever leave the kept set
            out["monotone"] &= all(not bool((new & ~old).any()) for old, new in zip(before, cb.masks, strict=True))
        out["loss"].append(loss)
        out["sparsity"].append(end.record["sparsity"])
        out["master"].append(_master_sparsity(engine, cb.views(info)))
        if ckpt is not None and step == RESUME_AT:
            engine.save_checkpoint(ckpt, {"step": step})
    return out


def _rank_main(strategy: Strategy, prune: dict, model_dir: str, work: str) -> dict:
    from orchestrate.backends.registry import get_backend
    from orchestrate.run.layout import RunDir
    from orchestrate.worker.callbacks.base import Training
    from tests.helpers.dist import init_gloo
    from tests.helpers.engines import cpu_rank, setup_engine

    torch.set_num_threads(1)  # 2 ranks on 2 shared cores
    rank, world = init_gloo()
    work_dir, plan = Path(work), _plan(strategy, prune)
    me = cpu_rank(rank, world, int(os.environ["LOCAL_RANK"]))
    backend = get_backend(strategy.backend)
    engine = setup_engine(backend, plan, me, model_dir)
    out = {"a": _run(Training(plan, me, RunDir(work_dir), engine, None, None, None, 0), range(1, STEPS + 1),
                     work_dir / "ckpt")}
    engine.save_hf_model(work_dir / "hf")
    del engine
    engine = setup_engine(backend, plan, me, model_dir)
    engine.load_checkpoint(work_dir / "ckpt")
    out["c"] = _run(Training(plan, me, RunDir(work_dir), engine, None, None, None, RESUME_AT),
                    range(RESUME_AT + 1, STEPS + 1))
    engine.save_hf_model(work_dir / "hf_resumed")
    return out


def _write_model(out: Path) -> Path:
    from orchestrate.loading.init_weights import build_initial_model

    return build_initial_model(_plan(Strategy("ddp", 0, "none", "none", "fp32", False, 4), {}), out)


def _saved_sparsity(path: Path, plan) -> float:
    from transformers import AutoModelForCausalLM

    kinds = {name for name, _, _ in prunable_linears(plan.shape, plan.config.prune)}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    weights = [m.weight for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in kinds]
    return sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)


STRATEGIES = {
    "ddp": Strategy("ddp", 0, "none", "none", "fp32", False, 4),
    "fsdp2": Strategy("fsdp", 3, "none", "none", "fp32", False, 4),
    "zero2": Strategy("deepspeed", 2, "none", "none", "fp32", False, 4),
    "zero3": Strategy("deepspeed", 3, "none", "none", "fp32", False, 4),
}
SCOPES = {"ddp": "global", "fsdp2": "global", "zero2": "per-layer", "zero3": "global"}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_magnitude_pruning_masks_survive_the_strategy(name, tmp_path):
    from tests.helpers.dist import run_on_ranks

    strategy, prune = STRATEGIES[name], {"scope": SCOPES[name]}
    plan = _plan(strategy, prune)
    results = run_on_ranks(_rank_main, 2, strategy, prune, str(_write_model(tmp_path / "init")), str(tmp_path))
    for rank, out in results.items():
        a, c = out["a"], out["c"]
        print(f"{name} rank {rank}: loss {[round(x, 3) for x in a['loss']]} sparsity "
              f"{[round(x, 3) for x in a['sparsity']]} master {a['master']}")
        assert a["sparsity"][0] < 0.01 and a["sparsity"][END - 1:] == pytest.approx([TARGET] * (STEPS - END + 1),
                                                                                   abs=0.01)
        assert all(x <= y + 1e-9 for x, y in itertools.pairwise(a["sparsity"])), "masks only grow"
        assert a["monotone"] and c["monotone"]
        if a["master"][0] is not None:  # ZeRO: the fp32 master is as sparse as the weights the model uses
            assert a["master"] == pytest.approx(a["sparsity"], abs=1e-9)
        # The loss recovers after the schedule ends (the last mask update is at END).
        assert min(a["loss"][END + 1:]) < a["loss"][END - 1], a["loss"]
        assert c["loss"] == a["loss"][RESUME_AT:], "resuming mid-schedule repeats the losses bit for bit"
        assert c["sparsity"] == a["sparsity"][RESUME_AT:]
    saved = _saved_sparsity(tmp_path / "hf", plan)
    print(f"{name}: sparsity of the saved model {saved:.4f}")
    assert abs(saved - TARGET) <= 0.01
    from safetensors.torch import load_file

    assert all(torch.equal(x, load_file(tmp_path / "hf_resumed" / "model.safetensors")[k])
               for k, x in load_file(tmp_path / "hf" / "model.safetensors").items()), "resumed weights differ"


STRUCTURED = {"method": "structured", "scope": "per-layer", "heads": True}


def _structured_main(model_dir: str, work: str) -> dict:
    out = _rank_main(STRATEGIES["fsdp2"], STRUCTURED, model_dir, work)
    if int(os.environ["RANK"]) == 0:
        from orchestrate.methods.prune.schedule import pruned_channels, pruned_heads
        from orchestrate.methods.prune.shrink import Cut, shrink_saved_model

        shape, prune = (plan := _plan(STRATEGIES["fsdp2"], STRUCTURED)).shape, plan.config.prune
        shutil.copytree(Path(work) / "hf", Path(work) / "hf_dense")
        out["changed"] = shrink_saved_model(Path(work) / "hf", Cut(pruned_channels(shape, prune),
                                                                   pruned_heads(shape, prune), 2, 16))
    return out


@pytest.mark.slow
def test_structured_pruning_saves_a_smaller_model_of_the_predicted_size(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.helpers.dist import run_on_ranks

    plan = _plan(STRATEGIES["fsdp2"], STRUCTURED)
    results = run_on_ranks(_structured_main, 2, str(_write_model(tmp_path / "init")), str(tmp_path))
    a = results[0]["a"]
    print("structured: loss", [round(x, 3) for x in a["loss"]], "sparsity", [round(x, 3) for x in a["sparsity"]])
    # 64 of 128 channels, and 1 of the 2 query heads of each of the 2 key/value heads
    assert a["sparsity"][-1] == TARGET
    assert results[0]["changed"] == {"intermediate_size": 64, "num_attention_heads": 2, "head_dim": 16}
    assert results[0]["c"]["loss"] == a["loss"][RESUME_AT:]
    assert min(a["loss"][END + 1:]) < a["loss"][END - 1], a["loss"]
    small = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_dense", dtype=torch.float32).eval()
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (saved["intermediate_size"], saved["num_attention_heads"], saved["num_key_value_heads"]) == (64, 2, 2)
    assert small.num_parameters() == pruned_parameters(plan.shape, plan.config.prune) < dense.num_parameters()
    probe = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():  # only zeroed channels were removed: the same function
        torch.testing.assert_close(small(input_ids=probe).logits, dense(input_ids=probe).logits, rtol=1e-5, atol=1e-5)
