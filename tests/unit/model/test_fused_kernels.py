"""Liger-Kernel's fused RMSNorm, RoPE and gated MLP (`train.fused_kernels`, orchestrate/model/fused_kernels.py).

On a CPU: the family map is the planner's FUSED_FAMILIES, each mapped liger function takes the keywords passed
to it and patches a tiny model of its family (under peft's wrappers too), each backend applies them between
building and wrapping the model, a CPU rank and an unknown family are refused with a message, and
`fused_kernels: true` without liger-kernel is a config problem. On a GPU (`gpu` mark): the patched model's
loss and gradients match the eager model's, and a DDP QLoRA engine trains with them as without.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import pytest

from orchestrate.errors import UserError
from orchestrate.model.fused_kernels import (
    LIGER_PATCHES,
    apply_fused_kernels,
    hf_model,
    liger_call,
)
from orchestrate.planner.activations import FAMILY_BLOCKS
from orchestrate.planner.long_context import FUSED_FAMILIES
from orchestrate.planner.strategy import Strategy
from tests.helpers.plans import make_plan

LIGER = importlib.util.find_spec("liger_kernel") is not None
needs_liger = pytest.mark.skipif(not LIGER, reason="liger-kernel is not installed (pip install 'orchestrate[gpu]')")

_SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 128, "vocab_size": 257, "max_position_embeddings": 64,
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # phi3 defaults to ids past this vocabulary
TINY = {family: {"model_type": family, **_SMALL, **({"head_dim": 16} if family == "gemma" else {})}
        for family in LIGER_PATCHES}
FUSED_DDP = Strategy("ddp", 0, "none", "none", "bf16", False, 1, fused_kernels=True)


def _modeling_module(family: str):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


@pytest.fixture
def restore_modeling_modules():
    """liger also rebinds names in the family's modeling module (RoPE, the norm and MLP classes): put them
    back, or every later test of this process would build Triton-only layers."""
    saved = {family: dict(vars(_modeling_module(family))) for family in LIGER_PATCHES}
    yield
    for family, names in saved.items():
        module = _modeling_module(family)
        for name in set(vars(module)) - set(names):
            delattr(module, name)
        vars(module).update(names)


def test_fused_kernels_cover_every_family_the_planner_turns_them_on_for():
    assert set(LIGER_PATCHES) == FUSED_FAMILIES
    # and those are the families of the planner's block table with RMSNorm and RoPE
    assert FUSED_FAMILIES == {f for f, block in FAMILY_BLOCKS.items() if block.norm.startswith("rmsnorm") and block.rope}


def test_fused_kernels_refuse_a_family_liger_does_not_patch():
    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*supported: gemma, llama, mistral, phi3, qwen2"):
        liger_call("gpt2")


def test_fused_kernels_refuse_a_cpu_rank():
    plan = make_plan(FUSED_DDP, ranks=1, config={"model": {"architecture": TINY["llama"]}})
    with pytest.raises(ValueError, match="need a CUDA GPU; this rank trains on cpu"):
        apply_fused_kernels(plan, object(), "cpu")


@pytest.mark.parametrize(("backend", "stage"), [("ddp", 0), ("fsdp", 3), ("deepspeed", 2)])
def test_each_backend_applies_the_fused_kernels_before_wrapping(backend, stage, tmp_path):
    """On a CPU rank each backend's set-up stops at the fused kernels' refusal: the call is there, between
    building the model and wrapping it."""
    import torch.distributed as dist

    from orchestrate.backends.registry import get_backend
    from orchestrate.loading.init_weights import build_initial_model
    from orchestrate.worker.objective import objective_for
    from tests.helpers.engines import builder, cpu_rank

    plan = make_plan(Strategy(backend, stage, "none", "none", "fp32", False, 1, fused_kernels=True), ranks=1,
                     config={"model": {"architecture": TINY["llama"]}})
    model_dir = build_initial_model(plan, tmp_path / "m")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="need a CUDA GPU; this rank trains on cpu"):
            get_backend(backend).setup(plan, cpu_rank(), model_dir, objective_for(plan), builder(plan))
    finally:
        dist.destroy_process_group()


def test_fused_kernels_off_leave_the_model_alone():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    plan = make_plan(Strategy("ddp", 0, "none", "none", "fp32", False, 1), ranks=1,
                     config={"model": {"architecture": TINY["llama"]}})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY["llama"]))
    apply_fused_kernels(plan, model, "cpu")  # off: no refusal on a CPU rank either
    assert {m._get_name() for m in model.modules()} & {"LlamaMLP", "LlamaRMSNorm"} == {"LlamaMLP", "LlamaRMSNorm"}
    assert not any(m._get_name().startswith("Liger") for m in model.modules())


def test_fused_kernels_pinned_without_liger_is_a_config_problem(monkeypatch):
    import orchestrate.config.requirements as deps

    real = importlib.util.find_spec
    monkeypatch.setattr(deps.importlib.util, "find_spec", lambda n: None if n == "liger_kernel" else real(n))
    with pytest.raises(UserError) as err:
        make_plan(FUSED_DDP, ranks=1, config={"train": {"fused_kernels": True}})
    assert "train.fused_kernels" in str(err.value)
    assert "needs liger_kernel" in str(err.value) and "pip install 'orchestrate[gpu]'" in str(err.value)
    # auto stays valid: the planner leaves it off without the library
    assert make_plan(FUSED_DDP, ranks=1, config={"train": {"fused_kernels": "auto"}}).config.train.fused_kernels == "auto"


@needs_liger
@pytest.mark.parametrize("family", sorted(LIGER_PATCHES))
def test_liger_function_takes_the_keywords_passed(family):
    import liger_kernel.transformers as liger

    name, kwargs = liger_call(family)
    parameters = inspect.signature(getattr(liger, name)).parameters
    assert set(kwargs) | {"model"} <= set(parameters)


@needs_liger
@pytest.mark.parametrize("family", sorted(LIGER_PATCHES))
@pytest.mark.parametrize("adapters", [False, True], ids=["plain", "lora"])
def test_liger_patches_every_block_of_a_tiny_model(family, adapters, restore_modeling_modules):
    """Patching only rebinds forward methods, so it runs on the meta device; under peft's wrappers too."""
    import liger_kernel.transformers as liger
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY[family]))
    if adapters:
        import peft

        targets = ["qkv_proj", "gate_up_proj"] if family == "phi3" else ["q_proj", "gate_proj"]
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))
    name, kwargs = liger_call(family)
    getattr(liger, name)(model=hf_model(model), **kwargs)
    layers = hf_model(model).model.layers
    names = {(layer.mlp._get_name(), layer.input_layernorm._get_name(), layer.post_attention_layernorm._get_name())
             for layer in layers}
    mlp = {"gemma": "LigerGEGLUMLP", "phi3": "LigerPhi3SwiGLUMLP"}.get(family, "LigerSwiGLUMLP")
    assert names == {(mlp, "LigerRMSNorm", "LigerRMSNorm")}
    assert hf_model(model).model.norm._get_name() == "LigerRMSNorm"


@pytest.mark.gpu
@needs_liger
@pytest.mark.parametrize("family", sorted(LIGER_PATCHES))
def test_fused_kernels_train_as_the_eager_model(family, restore_modeling_modules):
    """bf16 on a CUDA GPU: the same weights give the same loss and gradients with liger's kernels as without."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(**TINY[family])
    eager = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16)
    fused = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16)
    fused.load_state_dict(eager.state_dict())
    plan = make_plan(FUSED_DDP, ranks=1, config={"model": {"architecture": TINY[family]}})
    apply_fused_kernels(plan, fused, "cuda")
    ids = torch.randint(0, 257, (2, 48), device="cuda")
    losses, grads = [], []
    for model in (eager, fused):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    assert fused.model.layers[0].mlp._get_name().startswith("Liger")
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0).item() > 0.99


@pytest.mark.gpu
@needs_liger
def test_a_ddp_qlora_engine_trains_with_fused_kernels(tmp_path, restore_modeling_modules):
    """QLoRA under DDP on one CUDA rank, blocks checkpointed: the engine's blocks run liger's modules, and the
    loss falls as with the knob off, step for step within bf16 noise."""
    import gc

    import torch
    import torch.distributed as dist

    from orchestrate.backends.ddp import DDPBackend
    from orchestrate.loading.init_weights import build_initial_model
    from orchestrate.worker.objective import objective_for
    from tests.helpers.engines import builder, gpu_rank

    def plan(on: bool):
        strategy = Strategy("ddp", 0, "none", "none", "bf16", True, 2, fused_kernels=on)
        return make_plan(strategy, ranks=1, config={"model": {"architecture": TINY["llama"]}, "train": {
            "method": "qlora", "max_steps": 3, "optimizer": {"lr": 2e-2}, "schedule": {"warmup_steps": 1}}})

    model_dir = build_initial_model(plan(False), tmp_path / "m")
    ids = torch.randint(0, 257, (4, 48), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": t, "labels": t} for t in ids.split(2)]
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        losses, liger = {}, {}
        for on in (False, True):
            p = plan(on)
            engine = DDPBackend().setup(p, gpu_rank(), model_dir, objective_for(p), builder(p))
            liger[on] = sum(m._get_name().startswith("Liger") for m in engine.model.modules())
            losses[on] = [engine.train_step(batches).loss for _ in range(3)]
            del engine
            gc.collect()
    finally:
        dist.destroy_process_group()
    assert liger[False] == 0 and liger[True] == 2 * 3 + 1  # per block: the MLP and two norms; the final norm
    assert losses[True][-1] < losses[True][0], losses
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)
