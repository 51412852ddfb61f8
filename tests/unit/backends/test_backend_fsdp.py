"""FSDP2 backend: render (fast), the HF helpers it loads and saves with (fast), and real training on
2 gloo ranks (slow): full shard, grad-op + bf16 + activation checkpointing, hybrid shard, fp16
loss scaling, a llama-style model with rotary buffers, checkpoint resume and HF export."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from orchestrate.backends.fsdp import FSDPBackend, check_device, fsdp_settings
from orchestrate.backends.schedule import lr_multiplier
from orchestrate.errors import UserError
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.planner.strategy import Strategy
from tests.helpers.dist import init_gloo, run_on_ranks
from tests.helpers.engines import cpu_rank, gpu_rank, setup_engine
from tests.helpers.plans import TINY_GPT2, make_plan

TINY_LLAMA = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 257, "max_position_embeddings": 64,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}
# A learning rate and warm-up that make the tiny model's loss fall visibly within 8 steps.
FAST_TRAIN = {"max_steps": 8, "optimizer": {"lr": 1e-3}, "schedule": {"warmup_steps": 1}}
SEQ = 32


def fsdp(stage=3, precision="fp32", ac=False, mb=2, offload="none", hybrid=False) -> Strategy:
    return Strategy("fsdp", stage, offload, offload, precision, ac, mb, hybrid_shard=hybrid)


def plan_for(strategy: Strategy, arch: dict | None = None, nodes: int = 1):
    config = {"train": dict(FAST_TRAIN)}
    if arch is not None:
        config["model"] = {"architecture": dict(arch)}
    plan = make_plan(strategy, config=config)
    if nodes > 1:  # the same 2 ranks as 2 machines of 1 process: a (replicate=2, shard=1) mesh
        plan.hardware = HardwareProfile(name="cpu-test", nodes=nodes, gpus_per_node=0, cpu_processes=2 // nodes,
                                        cpu_memory_bytes=16 * 2**30, cpu_cores=2)
    return plan


def write_model(arch: dict, out: Path) -> Path:
    """The initial-weights directory the launcher writes for a from-scratch run (seed 0)."""
    from orchestrate.loading.init_weights import build_initial_model

    return build_initial_model(make_plan(fsdp(), config={"model": {"architecture": dict(arch)}}), out)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {"gpt2": str(write_model(TINY_GPT2, root / "gpt2")), "llama": str(write_model(TINY_LLAMA, root / "llama"))}


# ---------------------------------------------------------------- render (fast)

def test_render_full_shard_is_the_settings_setup_applies():
    plan = plan_for(fsdp(3, "fp32"))
    files = FSDPBackend().render(plan)
    assert list(files) == ["fsdp.json"]
    rendered = json.loads(files["fsdp.json"])
    assert rendered == json.loads(json.dumps(fsdp_settings(plan)))  # one function for render and setup
    assert rendered["mesh"] == {"shape": [2], "dim_names": ["shard"]}
    assert rendered["fully_shard"] == {"block_classes": ["GPT2Block"], "blocks": 2, "then_root": True,
                                       "reshard_after_forward": True}
    assert rendered["mixed_precision"] is None and rendered["cpu_offload"] is False
    assert rendered["gradient_accumulation"] == 2 and rendered["gradient_sync"] == "every_micro_batch"
    assert rendered["optimizer"]["fused"] is False  # CPU profile
    assert any("fully_shard each of the 2 GPT2Block blocks" in s for s in rendered["steps"])


def test_render_grad_op_bf16_checkpointed():
    st = fsdp_settings(plan_for(fsdp(2, "bf16", ac=True, mb=1)))
    assert st["fully_shard"]["reshard_after_forward"] is False
    assert st["mixed_precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert st["activation_checkpointing"] is True and st["loss_scaling"] is None
    assert st["gradient_accumulation"] == 4 and st["gradient_sync"] == "every_micro_batch"
    assert fsdp_settings(plan_for(fsdp(3, "fp16")))["loss_scaling"] == "dynamic"


def test_render_hybrid_mesh_and_llama_blocks():
    st = fsdp_settings(plan_for(fsdp(3, hybrid=True), TINY_LLAMA, nodes=2))
    assert st["mesh"] == {"shape": [2, 1], "dim_names": ["replicate", "shard"]}
    assert st["fully_shard"]["block_classes"] == ["LlamaDecoderLayer"]


def test_render_refuses_what_fsdp2_cannot_do():
    with pytest.raises(UserError, match="FSDP strategy"):
        fsdp_settings(plan_for(fsdp(1)))
    with pytest.raises(UserError, match="offload"):
        fsdp_settings(plan_for(Strategy("fsdp", 3, "cpu", "none", "fp32", False, 2)))
    with pytest.raises(UserError, match="offload"):
        fsdp_settings(plan_for(fsdp(3, offload="nvme")))


def test_cpu_offload_is_refused_on_a_cpu_device():
    st = fsdp_settings(plan_for(fsdp(3, offload="cpu")))
    assert st["cpu_offload"] is True
    with pytest.raises(UserError, match="needs a GPU"):
        check_device(st, torch.device("cpu"))


# ---------------------------------------------------------------- HF helpers (fast)

def test_read_full_state_dict_fills_tied_aliases_and_reports_mismatch(model_dirs, tmp_path):
    from transformers import AutoConfig

    from orchestrate.backends.hf_io import StateLayout
    from orchestrate.model.meta import build_meta_model
    from tests.helpers.loading import read_full_state_dict

    layout = StateLayout.of(build_meta_model(AutoConfig.from_pretrained(model_dirs["gpt2"])))
    assert layout.tie_groups == (("transformer.wte.weight", "lm_head.weight"),)
    state = read_full_state_dict(Path(model_dirs["gpt2"]), layout)
    assert set(state) == set(layout.tensors)
    assert state["lm_head.weight"] is state["transformer.wte.weight"]

    other = write_model({**TINY_GPT2, "n_embd": 32}, tmp_path / "other")
    with pytest.raises(UserError, match="do not match") as err:
        read_full_state_dict(other, layout)
    assert "shape mismatch" in str(err.value)
    with pytest.raises(UserError, match="no weights"):
        read_full_state_dict(tmp_path, layout)


def test_rotary_buffers_are_recomputed_after_to_empty(model_dirs):
    from transformers import AutoConfig, AutoModelForCausalLM

    from orchestrate.backends.hf_io import restore_non_persistent_buffers
    from orchestrate.model.meta import build_meta_model

    cfg = AutoConfig.from_pretrained(model_dirs["llama"])
    model = build_meta_model(cfg).to_empty(device="cpu")
    restore_non_persistent_buffers(model, torch.device("cpu"))
    reference = AutoModelForCausalLM.from_config(cfg)
    for name, buf in reference.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), buf, rtol=0, atol=0)



def test_a_buffer_whose_module_takes_no_config_is_recomputed_by_the_models_own_init():
    """Gemma's scaled embedding (transformers 5) keeps `embed_scale` = sqrt(hidden) in a non-persistent
    buffer and takes no config: the model's `_init_weights` fills it, and the embedding table is untouched."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from orchestrate.backends.hf_io import restore_non_persistent_buffers
    from orchestrate.model.meta import build_meta_model

    cfg = AutoConfig.for_model("gemma", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = build_meta_model(cfg).to_empty(device="cpu")
    with torch.no_grad():
        model.get_input_embeddings().weight.fill_(0.5)  # to_empty leaves garbage, NaN maybe
    restore_non_persistent_buffers(model, torch.device("cpu"))
    reference = AutoModelForCausalLM.from_config(cfg)
    assert float(model.get_buffer("model.embed_tokens.embed_scale")) == 8.0
    for name, buf in reference.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), buf, rtol=0, atol=0)
    assert bool((model.get_input_embeddings().weight == 0.5).all())

# ---------------------------------------------------------------- 2 gloo ranks (slow)

def _batches(rank: int, plan) -> list[dict[str, torch.Tensor]]:
    """This rank's fixed micro-batches of seeded random tokens (the same every step: memorisable)."""
    g = torch.Generator().manual_seed(1000 + rank)
    mb = plan.strategy.micro_batch_size
    ids = [torch.randint(0, 257, (mb, SEQ), generator=g) for _ in range(plan.chosen.gradient_accumulation)]
    return [{"input_ids": x, "labels": x} for x in ids]


def _probe() -> torch.Tensor:
    return torch.randint(0, 257, (2, SEQ), generator=torch.Generator().manual_seed(7))


def _logits(engine) -> torch.Tensor:
    engine.model.eval()
    with torch.no_grad():
        out = engine.model(input_ids=_probe()).logits.float()
    engine.model.train()
    return out


def _reload_logits(out_dir: Path) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=_probe()).logits, model.state_dict()


def _full_state(engine) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _train_resume_export(strategy: Strategy, arch: dict | None, model_dir: str, run_dir: str) -> dict:
    rank, world = init_gloo()
    plan = plan_for(strategy, arch)
    batches = _batches(rank, plan)
    backend = FSDPBackend()

    a = setup_engine(backend, plan, cpu_rank(rank, world), model_dir)
    results = [a.train_step(batches) for _ in range(4)]
    a.save_checkpoint(Path(run_dir) / "ckpt", {"step": 4, "note": "resume here"})
    results += [a.train_step(batches) for _ in range(4)]
    logits = _logits(a)
    a.save_hf_model(Path(run_dir) / "hf")
    trained = _full_state(a)

    again = setup_engine(backend, plan, cpu_rank(rank, world), model_dir)  # same seed, same data
    again_losses = [again.train_step(batches).loss for _ in range(8)]

    resumed = setup_engine(backend, plan, cpu_rank(rank, world), model_dir)
    client = resumed.load_checkpoint(Path(run_dir) / "ckpt")
    resumed_losses = [resumed.train_step(batches).loss for _ in range(4)]

    out = {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
           "lrs": [r.lr for r in results], "again": again_losses, "resumed": resumed_losses, "client": client}
    if arch is not None and arch["model_type"] == "llama":
        out["inv_freq_ok"] = all(
            torch.equal(b, getattr(type(m)(config=m.config), n))
            for m in a.model.modules() for n, b in m.named_buffers(recurse=False))
    if rank == 0:
        reloaded, reloaded_state = _reload_logits(Path(run_dir) / "hf")
        out["logit_diff"] = (reloaded - logits).abs().max().item()
        out["state_equal"] = all(torch.equal(reloaded_state[k], trained[k]) for k in trained)
        out["files"] = sorted(p.name for p in (Path(run_dir) / "hf").iterdir())
    return out


def _check_training(out: dict[int, dict]) -> None:
    for rank, r in out.items():
        assert r["losses"][-1] < r["losses"][0] - 0.3, f"rank {rank} loss did not fall: {r['losses']}"
        assert r["again"] == r["losses"], "same seed and data must give the same losses"
        assert r["resumed"] == pytest.approx(r["losses"][4:], abs=1e-6), "resume from step 4 diverged"
        assert r["client"] == {"step": 4, "note": "resume here"}
        assert all(math.isfinite(n) and n > 0 for n in r["norms"])
    assert out[0]["norms"] == out[1]["norms"]  # the global norm, identical on every rank
    assert out[0]["lrs"] == out[1]["lrs"] and out[0]["lrs"][0] == pytest.approx(1e-3)
    assert out[0]["state_equal"]
    assert out[0]["logit_diff"] < 1e-4
    assert "model.safetensors" in out[0]["files"] and "config.json" in out[0]["files"]


@pytest.mark.slow
def test_full_shard_trains_reproduces_resumes_and_exports(model_dirs, tmp_path):
    out = run_on_ranks(_train_resume_export, 2, fsdp(3, "fp32"), None, model_dirs["gpt2"], str(tmp_path))
    _check_training(out)


@pytest.mark.slow
def test_llama_with_rotary_buffers_trains_and_exports(model_dirs, tmp_path):
    out = run_on_ranks(_train_resume_export, 2, fsdp(3, "fp32"), TINY_LLAMA, model_dirs["llama"], str(tmp_path))
    _check_training(out)
    assert out[0]["inv_freq_ok"] and out[1]["inv_freq_ok"]


def _logits_dtype(engine) -> torch.dtype:
    with torch.no_grad():
        return engine.model(input_ids=_probe()).logits.dtype


def _grad_op_bf16(model_dir: str, run_dir: str) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    rank, world = init_gloo()
    plan = plan_for(fsdp(2, "bf16", ac=True))
    engine = setup_engine(FSDPBackend(), plan, cpu_rank(rank, world), model_dir)
    blocks = list(engine.model.transformer.h)
    batches = _batches(rank, plan)
    losses = [engine.train_step(batches).loss for _ in range(8)]
    engine.save_hf_model(Path(run_dir) / "hf")
    trained = _full_state(engine)
    out = {"losses": losses, "n_micro": len(batches),
           "wrapped": all(isinstance(b, CheckpointWrapper) and isinstance(b, FSDPModule) for b in blocks),
           "logits_dtype": str(_logits_dtype(engine))}
    if rank == 0:
        _, reloaded_state = _reload_logits(Path(run_dir) / "hf")
        out["state_equal"] = all(torch.equal(reloaded_state[k], trained[k]) for k in trained)
    return out


@pytest.mark.slow
def test_grad_op_bf16_with_activation_checkpointing_trains(model_dirs, tmp_path):
    out = run_on_ranks(_grad_op_bf16, 2, model_dirs["gpt2"], str(tmp_path))
    for r in out.values():
        assert r["n_micro"] == 2 and r["wrapped"]
        assert r["logits_dtype"] == "torch.bfloat16"  # MixedPrecisionPolicy computes in bf16
        assert r["losses"][-1] < r["losses"][0] - 0.3, r["losses"]
    assert out[0]["state_equal"]  # the fp32 master weights are what gets exported


def _hybrid_vs_flat(model_dir: str, run_dir: str) -> dict:
    rank, world = init_gloo()
    flat_plan = plan_for(fsdp(3))
    hybrid_plan = plan_for(fsdp(3, hybrid=True), nodes=2)
    batches = _batches(rank, flat_plan)
    flat = setup_engine(FSDPBackend(), flat_plan, cpu_rank(rank, world), model_dir)
    hybrid = setup_engine(FSDPBackend(), hybrid_plan, cpu_rank(rank, world), model_dir)
    placements = {str(p.placements) for p in hybrid.model.parameters()}
    return {"flat": [flat.train_step(batches).loss for _ in range(3)],
            "hybrid": [hybrid.train_step(batches).loss for _ in range(3)], "placements": placements}


@pytest.mark.slow
def test_hybrid_shard_matches_full_shard(model_dirs, tmp_path):
    out = run_on_ranks(_hybrid_vs_flat, 2, model_dirs["gpt2"], str(tmp_path))
    for r in out.values():
        assert r["placements"] == {"(Replicate(), Shard(dim=0))"}  # 2-D mesh: replicate x shard
        assert r["hybrid"] == pytest.approx(r["flat"], abs=1e-5)


def _fp16_overflow(model_dir: str, run_dir: str) -> dict:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    rank, world = init_gloo()
    plan = plan_for(fsdp(3, "fp16"))
    engine = setup_engine(FSDPBackend(), plan, cpu_rank(rank, world), model_dir)
    # A scale no fp16 gradient survives, backing off straight to 2**16: step 1 must be skipped.
    engine.scaler = ShardedGradScaler(device="cpu", init_scale=2.0**60, backoff_factor=2.0**-44)
    batches = _batches(rank, plan)
    results = [engine.train_step(batches) for _ in range(8)]
    return {"skipped": [r.skipped for r in results], "losses": [r.loss for r in results],
            "lrs": [r.lr for r in results]}


@pytest.mark.slow
def test_fp16_loss_scaling_skips_overflow_steps_on_every_rank(model_dirs, tmp_path):
    out = run_on_ranks(_fp16_overflow, 2, model_dirs["gpt2"], str(tmp_path))
    assert out[0]["skipped"] == out[1]["skipped"] == [True] + [False] * 7
    for r in out.values():
        assert r["losses"][1] == r["losses"][0]  # the skipped step left the weights untouched
        assert r["losses"][-1] < r["losses"][0] - 0.3, r["losses"]
    # The schedule counts the skipped step too (as the DeepSpeed backend does).
    train = plan_for(fsdp(3, "fp16")).config.train
    assert out[0]["lrs"] == pytest.approx([1e-3 * lr_multiplier(i, train) for i in range(8)])


def _cpu_offload_on_gpu(model_dir: str, run_dir: str) -> dict:
    import torch.distributed as dist

    from orchestrate.hardware.profile import GPUSpec

    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    plan = plan_for(fsdp(3, "bf16", offload="cpu"))
    plan.hardware = HardwareProfile(name="gpu-test", gpus_per_node=world, cpu_memory_bytes=16 * 2**30, gpu=GPUSpec(
        name="test", memory_bytes=8 * 2**30, compute_capability=(8, 0), peak_tflops_fp16=1, peak_tflops_bf16=1,
        peak_tflops_fp32=1))
    plan.chosen = dataclasses.replace(plan.chosen, gradient_accumulation=max(1, 8 // (2 * world)))
    engine = setup_engine(FSDPBackend(), plan, gpu_rank(rank, world), model_dir)
    devices = {p.device.type for p in engine.model.parameters()}
    losses = [engine.train_step(_batches(rank, plan)).loss for _ in range(6)]
    return {"devices": devices, "losses": losses}


@pytest.mark.gpu
@pytest.mark.slow
def test_cpu_offload_policy_keeps_shards_on_cpu_and_trains(model_dirs, tmp_path):
    ranks = min(2, torch.cuda.device_count())
    out = run_on_ranks(_cpu_offload_on_gpu, ranks, model_dirs["gpt2"], str(tmp_path))
    for r in out.values():
        assert r["devices"] == {"cpu"}
        assert r["losses"][-1] < r["losses"][0]
