"""`train.lora.dtype` trains the adapters in the dtype it names: one in-process gloo rank under DDP, a
tiny Llama, fp32 and bf16 adapters: every trainable parameter (and AdamW's states, kept in the
parameter's dtype) has that dtype, the frozen base does not change, and the loss falls."""

from __future__ import annotations

import pytest
import torch

from orchestrate.backends.ddp import DDPBackend
from orchestrate.planner.strategy import Strategy
from tests.helpers.engines import cpu_rank, setup_engine
from tests.helpers.plans import make_plan
from tests.methods.lora.test_lora_train import SEQ, TINY_LLAMA


def _plan(dtype: str):
    return make_plan(Strategy("ddp", 0, "none", "none", "fp32", False, 2), ranks=1, config={
        "model": {"architecture": dict(TINY_LLAMA)},
        "train": {"method": "lora", "lora": {"r": 8, "alpha": 16, "dtype": dtype}, "max_steps": 6,
                  "optimizer": {"lr": 2e-2}, "schedule": {"warmup_steps": 1}}})


def _run(dtype: str, model_dir: str) -> dict:
    engine = setup_engine(DDPBackend(), _plan(dtype), cpu_rank(), model_dir)
    module = engine.model.module
    batches = [{"input_ids": t, "labels": t}
               for t in torch.randint(0, 257, (4, SEQ), generator=torch.Generator().manual_seed(3)).split(2)]
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    losses = [engine.train_step(batches).loss for _ in range(6)]
    trained = {p.dtype for p in module.parameters() if p.requires_grad}
    states = {t.dtype for s in engine.optimizer.state.values() for t in s.values() if t.dim() > 0}
    same = all(torch.equal(p, frozen[n]) for n, p in module.named_parameters() if not p.requires_grad)
    return {"losses": losses, "trained": trained, "states": states, "same_base": same}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from orchestrate.loading.init_weights import build_initial_model

    return str(build_initial_model(_plan("fp32"), tmp_path_factory.mktemp("m") / "llama"))


@pytest.mark.slow  # two short trainings in-process: ~40 s on 2 busy cores
def test_the_adapters_train_in_the_configured_dtype(model_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runs = {dtype: _run(dtype, model_dir) for dtype in ("fp32", "bf16")}
    finally:
        dist.destroy_process_group()
    for dtype, expected in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        r = runs[dtype]
        print(f"lora.dtype {dtype}: losses {r['losses'][0]:.6f} -> {r['losses'][-1]:.6f}")
        assert r["trained"] == {expected} and r["states"] == {expected}, r
        assert r["same_base"] and r["losses"][-1] < r["losses"][0] - 0.1, r["losses"]
    assert runs["bf16"]["losses"] != runs["fp32"]["losses"]  # the bf16 adapters round their updates
