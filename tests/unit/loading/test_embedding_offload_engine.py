"""The input embedding in host memory, in the model and the DDP engine (loading/host_embedding.py,
backends/ddp.py). Without a GPU: the rest of a tiny Llama on the meta device, its table on the CPU, a
LoRA forward and backward run across the two; the DDP engine, in process on one gloo rank, trains LoRA and
QLoRA with the knob on exactly as with it off (on a CPU the routing moves nothing), leaves the table out of
DDP's broadcast and saves, checkpoints and merges as before. On a GPU (`gpu` mark): the table stays on the
CPU and the device holds that much less."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from orchestrate.loading.host_embedding import allocate, route_lookups, to_device_keeping_embedding
from orchestrate.planner.strategy import Strategy
from tests.methods.lora.test_lora_train import TINY_LLAMA, _batches
from tests.unit.backends.test_memory_knobs_train import STRATEGY as KNOB_STRATEGY
from tests.unit.backends.test_memory_knobs_train import knob_plan

META = torch.device("meta")


def _llama(**over):
    from transformers import LlamaConfig, LlamaForCausalLM

    arch = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    with META:
        return LlamaForCausalLM(LlamaConfig(**{**arch, **over}))


def test_the_lookup_runs_on_the_cpu_table_and_everything_else_on_the_device():
    import peft

    model = _llama()
    allocate(model, META, host_embedding=True)
    assert model.get_input_embeddings().weight.device.type == "cpu"
    assert {p.device.type for n, p in model.named_parameters() if "embed_tokens" not in n} == {"meta"}
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    route_lookups(model, META)
    seen = []  # registered after route_lookups: sees the ids the table gets
    model.get_input_embeddings().register_forward_pre_hook(lambda _m, args: seen.append(args[0].device))
    ids = torch.randint(0, 257, (2, 16))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    table = model.get_input_embeddings().weight
    assert seen == [torch.device("cpu")] and table.device.type == "cpu" and table.grad is None
    assert out.logits.device == META and out.loss.device == META
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(p.grad is not None and p.grad.device == META for p in lora)


def test_ids_go_to_the_table_wherever_it_is():
    model = _llama()
    model.to_empty(device=META)  # the table on the device, the ids on the CPU: the pre-hook moves them
    route_lookups(model, META)
    seen = []
    model.get_input_embeddings().register_forward_pre_hook(lambda _m, args: seen.append(args[0].device))
    assert model(input_ids=torch.randint(0, 257, (1, 8))).logits.device == META and seen == [META]


def test_moving_the_model_leaves_the_table_on_the_cpu():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}))
    to_device_keeping_embedding(model, META)
    assert model.get_input_embeddings().weight.device.type == "cpu"
    assert {p.device.type for n, p in model.named_parameters() if "embed_tokens" not in n} == {"meta"}
    assert model.model.embed_tokens is model.get_input_embeddings()  # put back where it was


def test_a_tied_embedding_is_refused():
    model = _llama(tie_word_embeddings=True)
    with pytest.raises(RuntimeError, match="tied"):
        route_lookups(model, META)


def _engine_run(method: str, offload: bool, model_dir: str, run_dir: Path, ranks: int = 1) -> dict:
    from safetensors.torch import load_file

    from orchestrate.backends.ddp import DDPBackend
    from orchestrate.methods.lora.saving import save_merged_and_adapter
    from orchestrate.run.layout import RunDir
    from orchestrate.worker.objective import objective_for
    from tests.helpers.engines import builder, cpu_rank
    from tests.helpers.plans import make_plan

    strategy = replace(KNOB_STRATEGY, embedding_offload=offload)
    plan = make_plan(strategy, ranks=ranks, config={
        "model": {"architecture": dict(TINY_LLAMA)},
        "train": {"method": method, "max_steps": 3, "optimizer": {"lr": 2e-2}, "schedule": {"warmup_steps": 1}}})
    rank = torch.distributed.get_rank()
    me = cpu_rank(rank, ranks)
    engine = DDPBackend().setup(plan, me, Path(model_dir), objective_for(plan), builder(plan))
    losses = [engine.train_step(_batches(rank)).loss for _ in range(3)]
    engine.save_checkpoint(run_dir / "ckpt", {"step": 3})
    save_merged_and_adapter(plan, engine, RunDir(run_dir), rank == 0)  # run_dir/model: the merged model
    saved = torch.load(run_dir / "ckpt" / "trainer_state.pt", weights_only=True)["model"]
    module = engine.model.module
    resumed = DDPBackend().setup(plan, me, Path(model_dir), objective_for(plan), builder(plan))
    resumed.load_checkpoint(run_dir / "ckpt")
    merged = load_file(run_dir / "model" / "model.safetensors")["model.embed_tokens.weight"]
    return {"losses": losses, "ignored": sorted(getattr(engine.model, "parameters_to_ignore", [])),
            "wrapper": type(engine.model).__name__, "ckpt": sorted(saved),
            "next": engine.train_step(_batches(rank)).loss, "resumed_next": resumed.train_step(_batches(rank)).loss,
            "merged": torch.equal(merged, module.get_input_embeddings().weight.detach().float()),
            "table_grad": module.get_input_embeddings().weight.requires_grad,
            "table_sum": module.get_input_embeddings().weight.double().sum().item(),
            "adapters": sum(p.double().sum().item() for p in module.parameters() if p.requires_grad)}


def test_the_ddp_engine_trains_lora_and_qlora_with_the_table_on_the_host_as_without(tmp_path):
    import torch.distributed as dist

    from orchestrate.loading.init_weights import build_initial_model

    model_dir = str(build_initial_model(knob_plan("full"), tmp_path / "llama"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runs = {(m, on): _engine_run(m, on, model_dir, tmp_path / f"{m}-{on}")
                for m in ("lora", "qlora") for on in (False, True)}
    finally:
        dist.destroy_process_group()
    for method in ("lora", "qlora"):
        on, off = runs[(method, True)], runs[(method, False)]
        print(f"{method}: losses on {on['losses']}, off {off['losses']}; ignored by DDP {on['ignored']}")
        assert on["losses"] == off["losses"] and on["losses"][-1] < on["losses"][0]
        # One rank trains without DDP (backends/single_rank.py): nothing to broadcast, nothing ignored; the
        # two-rank test below checks that DDP leaves the host table out.
        assert on["wrapper"] == off["wrapper"] == "SingleRank" and on["ignored"] == off["ignored"] == []
        assert on["ckpt"] == off["ckpt"] and not any("embed" in key for key in on["ckpt"])
        assert on["resumed_next"] == on["next"]  # resumed bit-exact from an adapters-only checkpoint
        assert on["merged"] and on["table_grad"] is False  # the merged export holds the host table


@pytest.mark.gpu
def test_on_a_gpu_the_table_never_touches_the_device(tmp_path):
    """QLoRA on one CUDA rank: the table stays on the CPU, the rest on the GPU, the loss falls, and the
    device holds the table's bytes less than with the knob off (a vocabulary large enough to see it)."""
    import gc

    import torch.distributed as dist

    from orchestrate.backends.ddp import DDPBackend
    from orchestrate.loading.init_weights import build_initial_model
    from orchestrate.worker.objective import objective_for
    from tests.helpers.engines import builder, gpu_rank
    from tests.helpers.plans import make_plan

    arch = {**TINY_LLAMA, "vocab_size": 32768, "hidden_size": 256, "num_attention_heads": 4}
    table = 32768 * 256 * 2  # bf16

    def plan(on: bool):
        strategy = Strategy("ddp", 0, "none", "none", "bf16", True, 2, embedding_offload=on)
        return make_plan(strategy, ranks=1, config={"model": {"architecture": arch}, "train": {
            "method": "qlora", "max_steps": 3, "optimizer": {"lr": 2e-2}, "schedule": {"warmup_steps": 1}}})

    model_dir = build_initial_model(plan(False), tmp_path / "m")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        held = {}
        for on in (False, True):
            gc.collect()  # the first engine freed now, not during the second's setup (which is measured)
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            p = plan(on)
            engine = DDPBackend().setup(p, gpu_rank(), model_dir, objective_for(p), builder(p))
            held[on] = torch.cuda.memory_allocated() - before
            ids = torch.randint(0, 32768, (4, 32), generator=torch.Generator().manual_seed(0))
            batches = [{"input_ids": t, "labels": t} for t in ids.split(2)]
            losses = [engine.train_step(batches).loss for _ in range(3)]
            module = engine.model.module
            if on:
                assert module.get_input_embeddings().weight.device.type == "cpu"
                assert {q.device.type for n, q in module.named_parameters() if "embed_tokens" not in n} == {"cuda"}
            assert losses[-1] < losses[0], losses
            del engine, module
        print(f"device bytes after setup: off {held[False]}, on {held[True]}, table {table}")
        assert held[False] - held[True] == pytest.approx(table, rel=0.05)
    finally:
        dist.destroy_process_group()


def _two_ranks(model_dir: str, run_dir: str) -> dict:
    from tests.helpers.dist import init_gloo

    rank, world = init_gloo()
    out = _engine_run("qlora", True, model_dir, Path(run_dir), ranks=world)  # rank 0 writes, all read
    return {"losses": out["losses"], "ignored": out["ignored"], "table": out["table_sum"], "adapters": out["adapters"]}


@pytest.mark.slow
def test_two_ddp_ranks_train_with_their_own_host_tables_and_stay_replicas(tmp_path):
    """2 gloo ranks: DDP broadcasts nothing of the table (ignored), each rank's copy came from the same
    files, and the adapters stay equal across ranks while the loss falls."""
    from orchestrate.loading.init_weights import build_initial_model
    from tests.helpers.dist import run_on_ranks

    model_dir = str(build_initial_model(knob_plan("full"), tmp_path / "llama"))
    out = run_on_ranks(_two_ranks, 2, model_dir, str(tmp_path))
    print({rank: r["losses"] for rank, r in out.items()})
    assert out[0]["table"] == out[1]["table"] and out[0]["adapters"] == out[1]["adapters"]
    assert all(r["losses"][-1] < r["losses"][0] for r in out.values())
    assert all(r["ignored"] == ["base_model.model.model.embed_tokens.weight"] for r in out.values())
