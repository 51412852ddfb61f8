"""DDP backend: render (fast) and real training on 2 gloo ranks (slow): it trains, resumes and
exports; gradient accumulation equals one larger micro-batch; bf16 autocast with checkpointing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orchestrate.backends.ddp import DDPBackend, ddp_settings
from orchestrate.errors import UserError
from orchestrate.planner.strategy import Strategy
from tests.helpers.dist import init_gloo, run_on_ranks
from tests.helpers.engines import cpu_rank, setup_engine
from tests.helpers.plans import make_plan

FAST_TRAIN = {"max_steps": 8, "optimizer": {"lr": 1e-3}, "schedule": {"warmup_steps": 1}}
SEQ = 32


def ddp(precision="fp32", ac=False, mb=2) -> Strategy:
    return Strategy("ddp", 0, "none", "none", precision, ac, mb)


def plan_for(strategy: Strategy, global_batch: int = 8):
    return make_plan(strategy, config={"train": {**FAST_TRAIN, "global_batch_size": global_batch}})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The initial-weights directory the launcher writes for a from-scratch run."""
    from orchestrate.loading.init_weights import build_initial_model

    return str(build_initial_model(plan_for(ddp()), tmp_path_factory.mktemp("m") / "gpt2"))


def test_render_is_the_settings_setup_applies():
    plan = plan_for(ddp("bf16", ac=True))
    files = DDPBackend().render(plan)
    assert list(files) == ["ddp.json"]
    st = json.loads(files["ddp.json"])
    assert st == json.loads(json.dumps(ddp_settings(plan)))
    assert st["autocast_dtype"] == "bfloat16" and st["loss_scaling"] is None
    assert st["activation_checkpointing"] and st["block_classes"] == ["GPT2Block"]
    assert st["gradient_accumulation"] == 2 and st["world_size"] == 2
    assert ddp_settings(plan_for(ddp("fp16")))["loss_scaling"] == "dynamic"
    assert ddp_settings(plan_for(ddp("fp32")))["autocast_dtype"] is None


def test_render_refuses_sharding_and_offload():
    with pytest.raises(UserError, match="DDP"):
        ddp_settings(plan_for(Strategy("ddp", 2, "none", "none", "fp32", False, 2)))
    with pytest.raises(UserError, match="DDP"):
        ddp_settings(plan_for(Strategy("ddp", 0, "cpu", "none", "fp32", False, 2)))


def _tokens(rank: int, n: int) -> torch.Tensor:
    return torch.randint(0, 257, (n, SEQ), generator=torch.Generator().manual_seed(1000 + rank))


def _split(tokens: torch.Tensor, mb: int) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": x, "labels": x} for x in tokens.split(mb)]


def _probe() -> torch.Tensor:
    return torch.randint(0, 257, (2, SEQ), generator=torch.Generator().manual_seed(7))


def _train_resume_export(model_dir: str, run_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    rank, world = init_gloo()
    plan = plan_for(ddp())
    batches = _split(_tokens(rank, 4), 2)
    a = setup_engine(DDPBackend(), plan, cpu_rank(rank, world), model_dir)
    results = [a.train_step(batches) for _ in range(4)]
    a.save_checkpoint(Path(run_dir) / "ckpt", {"step": 4})
    results += [a.train_step(batches) for _ in range(4)]
    a.save_hf_model(Path(run_dir) / "hf")
    resumed = setup_engine(DDPBackend(), plan, cpu_rank(rank, world), model_dir)
    client = resumed.load_checkpoint(Path(run_dir) / "ckpt")
    out = {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results], "client": client,
           "resumed": [resumed.train_step(batches).loss for _ in range(4)],
           "eval": a.eval_sums(batches[0])["loss"]}
    if rank == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(Path(run_dir) / "hf", dtype=torch.float32).eval()
        a.model.eval()
        with torch.no_grad():
            diff = (reloaded(input_ids=_probe()).logits - a.model.module(input_ids=_probe()).logits).abs().max()
        out["logit_diff"] = diff.item()
    return out


@pytest.mark.slow
def test_ddp_trains_resumes_and_exports(model_dir, tmp_path):
    out = run_on_ranks(_train_resume_export, 2, model_dir, str(tmp_path))
    for rank, r in out.items():
        assert r["losses"][-1] < r["losses"][0] - 0.3, f"rank {rank}: {r['losses']}"
        assert r["resumed"] == pytest.approx(r["losses"][4:], abs=1e-6)
        assert r["client"] == {"step": 4}
        assert r["eval"] < r["losses"][0]
    assert out[0]["norms"] == out[1]["norms"]  # all-reduced gradients: one global norm
    assert out[0]["logit_diff"] < 1e-5


def _accumulation_vs_one_batch(model_dir: str, run_dir: str) -> dict:
    rank, world = init_gloo()
    tokens = _tokens(rank, 2)  # this rank's share of a global batch of 4
    one = setup_engine(DDPBackend(), plan_for(ddp(mb=2), global_batch=4), cpu_rank(rank, world), model_dir)
    acc = setup_engine(DDPBackend(), plan_for(ddp(mb=1), global_batch=4), cpu_rank(rank, world), model_dir)
    assert one.settings["gradient_accumulation"] == 1 and acc.settings["gradient_accumulation"] == 2
    steps = []
    for _ in range(2):
        r1, r2 = one.train_step(_split(tokens, 2)), acc.train_step(_split(tokens, 1))
        steps.append(((r1.loss, r1.grad_norm), (r2.loss, r2.grad_norm)))
    diff = max((p1 - p2).abs().max().item() for p1, p2 in zip(one.model.parameters(), acc.model.parameters(), strict=True))
    return {"steps": steps, "param_diff": diff}


@pytest.mark.slow
def test_accumulation_matches_one_larger_micro_batch(model_dir, tmp_path):
    """micro 2 x accum 1 and micro 1 x accum 2 on the same global batch take the same step."""
    out = run_on_ranks(_accumulation_vs_one_batch, 2, model_dir, str(tmp_path))
    for r in out.values():
        for (loss1, norm1), (loss2, norm2) in r["steps"]:
            assert loss2 == pytest.approx(loss1, abs=1e-5)
            assert norm2 == pytest.approx(norm1, rel=1e-5)
        assert r["param_diff"] < 1e-5


def _bf16_checkpointed(model_dir: str, run_dir: str) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    rank, world = init_gloo()
    engine = setup_engine(DDPBackend(), plan_for(ddp("bf16", ac=True)), cpu_rank(rank, world), model_dir)
    batches = _split(_tokens(rank, 4), 2)
    seen = []  # the dtype the engine's own forward computes the logits in
    engine.model.module.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(str(out.dtype)))
    losses = [engine.train_step(batches).loss for _ in range(8)]
    return {"losses": losses, "logits_dtype": set(seen),
            "wrapped": all(isinstance(b, CheckpointWrapper) for b in engine.model.module.transformer.h),
            "master_dtype": str(next(engine.model.parameters()).dtype)}


@pytest.mark.slow
def test_bf16_autocast_with_activation_checkpointing_trains(model_dir, tmp_path):
    out = run_on_ranks(_bf16_checkpointed, 2, model_dir, str(tmp_path))
    for r in out.values():
        assert r["wrapped"] and r["master_dtype"] == "torch.float32" and r["logits_dtype"] == {"torch.bfloat16"}
        assert r["losses"][-1] < r["losses"][0] - 0.3, r["losses"]
