"""The memory knobs train (2 gloo ranks, tiny Llama): under DDP bitsandbytes AdamW8bit with the loss
in chunks, full fine-tuning and QLoRA (whose base is quantized as it loads); under FSDP2 the chunked
loss equals the whole one; under DeepSpeed ZeRO-2 / ZeRO-3 (QLoRA also with parameters and optimizer
offloaded) the chunked loss and activation offload each give the plain run's losses. Activation
offload's pinning needs a GPU: the planner refuses it on CPU (tests/unit/planner/test_memory_knobs.py), so here it
runs unpinned, which checks the wiring and the numbers, not the memory."""

from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from orchestrate.backends.ddp import DDPBackend
from orchestrate.planner.strategy import Strategy
from tests.helpers.dist import init_gloo, run_on_ranks
from tests.helpers.plans import make_plan
from tests.methods.lora.test_lora_train import TINY_LLAMA, _batches

STRATEGY = replace(Strategy("ddp", 0, "none", "none", "fp32", False, 2), loss_chunks=4, optimizer="adamw8bit")


def knob_plan(method: str):
    return make_plan(STRATEGY, config={
        "model": {"architecture": dict(TINY_LLAMA)},
        "train": {"method": method, "max_steps": 6, "optimizer": {"lr": 2e-2}, "schedule": {"warmup_steps": 1}}})


def _train(model_dir: str, run_dir: str) -> dict:
    from orchestrate.worker.objective import objective_for
    from tests.helpers.engines import builder, cpu_rank

    rank, world = init_gloo()
    out = {}
    for method in ("full", "qlora"):
        plan = knob_plan(method)
        engine = DDPBackend().setup(plan, cpu_rank(rank, world), Path(model_dir), objective_for(plan), builder(plan))
        losses = [engine.train_step(_batches(rank)).loss for _ in range(6)]
        states = {str(v.dtype) for st in engine.optimizer.state.values() for key, v in st.items()
                  if key in ("state1", "state2")}
        weights = torch.cat([p.detach().flatten() for p in engine.model.parameters() if p.requires_grad])
        gathered = [torch.empty_like(weights) for _ in range(world)]
        torch.distributed.all_gather(gathered, weights)
        out[method] = {"losses": losses, "states": sorted(states), "optimizer": type(engine.optimizer).__name__,
                       "chunks": engine.objective.loss_chunks, "replicas_equal": torch.equal(*gathered)}
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from orchestrate.loading.init_weights import build_initial_model

    return str(build_initial_model(knob_plan("full"), tmp_path_factory.mktemp("m") / "llama"))


@pytest.mark.slow
def test_ddp_trains_with_adamw8bit_and_a_chunked_loss(model_dir, tmp_path):
    out = run_on_ranks(_train, 2, model_dir, str(tmp_path))
    for method in ("full", "qlora"):
        r = out[0][method]
        print(f"{method}: {r['optimizer']}, states {r['states']}, {r['chunks']} loss chunks, "
              f"losses {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}")
        assert r["optimizer"] == "AdamW8bit" and r["chunks"] == 4
        assert r["losses"][-1] < r["losses"][0] - 0.2, r["losses"]
        assert all(out[rank][method]["replicas_equal"] for rank in out)
    # 8-bit states for the full model's matrices (>= 4096 values); LoRA adapters this small stay 32-bit
    # (bitsandbytes min_8bit_size)
    assert "torch.uint8" in out[0]["full"]["states"]



def _fsdp_chunked_vs_whole(model_dir: str, run_dir: str) -> dict:
    from orchestrate.backends.fsdp import FSDPBackend
    from orchestrate.worker.objective import objective_for
    from tests.helpers.engines import builder, cpu_rank

    rank, world = init_gloo()
    out = {}
    for chunks in (0, 4):
        strategy = replace(Strategy("fsdp", 3, "none", "none", "fp32", True, 2), loss_chunks=chunks)
        plan = make_plan(strategy, config={"model": {"architecture": dict(TINY_LLAMA)},
                                           "train": {"max_steps": 2, "optimizer": {"lr": 2e-2},
                                                     "schedule": {"warmup_steps": 1}}})
        engine = FSDPBackend().setup(plan, cpu_rank(rank, world), Path(model_dir), objective_for(plan), builder(plan))
        steps = [engine.train_step(_batches(rank)) for _ in range(2)]
        out[chunks] = {"losses": [s.loss for s in steps], "norms": [s.grad_norm for s in steps]}
    return out


@pytest.mark.slow
def test_fsdp2_full_shard_with_checkpointing_chunked_loss_equals_the_whole_loss(model_dir, tmp_path):
    """FSDP2 (the root unit holds the LM head; blocks checkpointed): 2 steps with 4 loss chunks give the
    unchunked run's losses and gradient norms, so the chunks' gradients reach the sharded head."""
    out = run_on_ranks(_fsdp_chunked_vs_whole, 2, model_dir, str(tmp_path))
    for rank, r in out.items():
        print(f"rank {rank}: whole {r[0]}, chunked {r[4]}")
        assert r[4]["losses"] == pytest.approx(r[0]["losses"], rel=1e-5)
        assert r[4]["norms"] == pytest.approx(r[0]["norms"], rel=1e-4)


DEEPSPEED = {"zero2": Strategy("deepspeed", 2, "none", "none", "fp32", True, 2),
             "zero3": Strategy("deepspeed", 3, "none", "none", "fp32", True, 2),
             "zero3_offload": Strategy("deepspeed", 3, "cpu", "cpu", "fp32", True, 2)}
"""Activation checkpointing on in each (activation offload offloads what it keeps)."""
DEEPSPEED_CASES = [("full", "zero2"), ("full", "zero3"), ("lora", "zero2"), ("lora", "zero3"),
                   ("qlora", "zero3_offload")]
"""The trained head (full) and the frozen one (lora) on both stages; QLoRA on fsdp_qlora's layout, the plan
that needs the knobs on one small card (the NF4 base's partitions and the adapters' optimizer on the host)."""
KNOBS = {"plain": {}, "loss_chunks": {"loss_chunks": 4}, "activation_offload": {"activation_offload": True}}


def _deepspeed_with_and_without_knobs(model_dir: str) -> dict:
    from orchestrate.backends.deepspeed_backend import DeepSpeedBackend
    from orchestrate.worker.objective import objective_for
    from tests.helpers.engines import builder, cpu_rank

    rank, world = init_gloo()
    # Every plan first: while a ZeRO-3 engine lives, transformers builds any model (the plan's meta one
    # too) under ZeRO-3's partitioning init.
    plans = {(method, stage, knob): make_plan(replace(DEEPSPEED[stage], **settings), config={
        "model": {"architecture": dict(TINY_LLAMA)},
        "train": {"method": method, "max_steps": 3, "optimizer": {"lr": 2e-2}, "schedule": {"warmup_steps": 1}}})
        for method, stage in DEEPSPEED_CASES for knob, settings in KNOBS.items()}
    offloaded: list[dict] = []
    head_calls: list[int] = []
    real = torch.autograd.graph.save_on_cpu

    def recording(*args, **kwargs):
        offloaded.append(kwargs)
        return real(*args, **kwargs)

    torch.autograd.graph.save_on_cpu = recording
    out = {}
    for key, plan in plans.items():
        engine = DeepSpeedBackend().setup(plan, cpu_rank(rank, world), Path(model_dir), objective_for(plan), builder(plan))
        engine.engine.module.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(1))
        offloaded.clear()
        head_calls.clear()
        steps = [engine.train_step(_batches(rank)) for _ in range(3)]
        out[key] = {"losses": [s.loss for s in steps], "norms": [s.grad_norm for s in steps],
                    "head_calls": len(head_calls), "offloaded": list(offloaded)}
        del engine
        gc.collect()  # its ZeRO-3 switch (transformers' weak reference) off before the next base is built
    return out


@pytest.mark.slow
def test_deepspeed_losses_with_loss_chunks_or_activation_offload_equal_the_plain_run(model_dir):
    """3 steps of 2 micro-batches each: the LM head runs once more per micro-batch with chunks (the chunk
    loop as one call of the module, ZeRO-3 gathering it), the forward inside save_on_cpu with offload
    (unpinned on CPU), and the losses and gradient norms are the plain run's."""
    out = run_on_ranks(_deepspeed_with_and_without_knobs, 2, model_dir)
    for rank, r in out.items():
        for method, stage in DEEPSPEED_CASES:
            plain = r[method, stage, "plain"]
            if rank == 0:
                gaps = {knob: max(abs(a - b) for a, b in zip(r[method, stage, knob]["losses"], plain["losses"],
                                                             strict=True)) for knob in ("loss_chunks", "activation_offload")}
                print(f"{method} {stage}: plain {plain['losses'][0]:.6f} -> {plain['losses'][-1]:.6f}; max |loss - "
                      f"plain|: " + ", ".join(f"{knob} {gap:.1e}" for knob, gap in gaps.items()))
            assert plain["head_calls"] == 6 and not plain["offloaded"], (method, stage, plain)
            assert r[method, stage, "loss_chunks"]["head_calls"] == 12, (method, stage)
            assert r[method, stage, "activation_offload"]["offloaded"] == [{"pin_memory": False}] * 6, (method, stage)
            for knob in ("loss_chunks", "activation_offload"):
                run = r[method, stage, knob]
                assert run["losses"] == pytest.approx(plain["losses"], abs=1e-5), (method, stage, knob, run, plain)
                assert run["norms"] == pytest.approx(plain["norms"], rel=1e-4), (method, stage, knob, run, plain)
            assert plain["losses"][-1] < plain["losses"][0], (method, stage, plain["losses"])
