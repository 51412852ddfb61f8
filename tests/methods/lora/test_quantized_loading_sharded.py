"""QLoRA's base under FSDP2 and DeepSpeed ZeRO-2/3 quantized as it loads on the CPU
(methods/lora/quantized_loading.py `load_adapter_base`), not read whole in 16-bit by every rank and quantized
afterwards: bitsandbytes really quantizes on a move to the CPU, the NF4 bytes and constants equal the
old path's for the same base, the 16-bit loader is never called (also through the backends' own
`setup` on 2 gloo ranks), and the live tensors at the load's peak are the NF4 model plus one tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrate.methods.lora.transform import add_adapters, compute_dtype, quant_storage
from orchestrate.planner.strategy import Strategy
from tests.helpers.engines import cpu_rank, setup_engine
from tests.helpers.plans import make_plan
from tests.methods.lora.test_quantized_loading import ARCHS, BIG

SHARDING = {"fsdp": Strategy("fsdp", 3, "none", "none", "fp32", False, 2),
            "zero2": Strategy("deepspeed", 2, "none", "none", "fp32", False, 2),
            "zero3": Strategy("deepspeed", 3, "none", "none", "fp32", False, 2)}
STORAGE = {"fsdp": torch.float32, "zero2": torch.uint8, "zero3": torch.float32}
"""bnb_4bit_quant_storage: the compute dtype (fp32 on CPU) where the backend shards the base, else uint8."""


def _plan(backend: str, arch: dict):
    return make_plan(SHARDING[backend], config={"model": {"architecture": dict(arch)}, "train": {"method": "qlora"}})


def _no_16bit_load(*args, **kwargs):
    raise AssertionError("load_replicated read the 16-bit base")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # NF4 codes stored as float32 are arbitrary bit patterns (NaN now and then): compare bytes, not values.
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def test_params4bit_moved_to_the_cpu_is_quantized_there():
    """bitsandbytes 0.50.2 Params4bit.to: any non-meta device quantizes on the first move (nn/modules.py)."""
    import bitsandbytes as bnb

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    for storage in (torch.uint8, torch.float32):
        p = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type="nf4", quant_storage=storage).to("cpu")
        assert p.bnb_quantized and p.dtype == storage and p.device.type == "cpu"
        assert p.numel() * p.element_size() == w.numel() // 2  # two 4-bit codes per byte
        back = bnb.functional.dequantize_4bit(p.data, p.quant_state)
        assert back.shape == w.shape and 0 < (back - w).abs().mean() < 0.1 * w.abs().mean()


@pytest.mark.parametrize("family", sorted(ARCHS))
@pytest.mark.parametrize("backend", sorted(SHARDING))
def test_the_sharding_backends_base_equals_the_old_16bit_path(backend, family, tmp_path, monkeypatch):
    """Same NF4 codes, absmax and nested constants, biases and adapters' init as reading the base whole
    in the compute dtype and quantizing it afterwards (what FSDP2/DeepSpeed setup did before)."""
    import bitsandbytes as bnb
    from transformers import AutoConfig, AutoModelForCausalLM

    from orchestrate.loading import weights as loading
    from orchestrate.methods.lora.loading import load_adapter_base

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**ARCHS[family])).save_pretrained(tmp_path)
    plan = _plan(backend, ARCHS[family])
    old = loading.load_replicated(tmp_path, torch.device("cpu"), compute_dtype(plan))
    monkeypatch.setattr(loading, "load_replicated", _no_16bit_load)
    new, layout = load_adapter_base(tmp_path, plan)
    assert sorted(layout.tensors) == sorted(old.state_dict())  # the base's keys, for the merged export
    linears = [m for m in new.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 2 * 7  # every block linear, before the LoRA transform
    for m in linears:
        assert m.weight.bnb_quantized and m.weight.dtype == STORAGE[backend] == quant_storage(plan)
        assert m.quant_state is m.weight.quant_state  # module=new: FSDP2's unsharded copy finds it there
    torch.manual_seed(1)  # the adapters' random init
    before = add_adapters(old, plan).state_dict()
    torch.manual_seed(1)
    during = add_adapters(new, plan).state_dict()
    assert before.keys() == during.keys()
    assert sum(k.endswith("weight.absmax") for k in during) == 2 * 7  # quantized once, not again
    for key in before:
        assert before[key].dtype == during[key].dtype and before[key].shape == during[key].shape, key
        assert torch.equal(_as_bytes(before[key]), _as_bytes(during[key])), key


def test_fsdp_cpu_load_holds_the_nf4_model_and_one_tensor_not_the_16bit_base(tmp_path):
    """Live tensor bytes at the peak (simulate's counter). The old path read the whole base in the compute
    dtype (fp32 here): at least 4 B/param, so `< params` cannot pass with it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from orchestrate.loading.weights import load_replicated
    from orchestrate.methods.lora.adapters import adapters_for
    from orchestrate.methods.lora.loading import load_adapter_base
    from orchestrate.methods.lora.memory import base_bytes, quantized_load_bytes
    from orchestrate.simulate.counter import LiveStorageCounter

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**BIG)).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp_path)
    del model
    plan = _plan("fsdp", BIG)
    peaks = {}
    for how, load in (("old", lambda: load_replicated(tmp_path, torch.device("cpu"), compute_dtype(plan))),
                      ("new", lambda: load_adapter_base(tmp_path, plan)[0])):
        with LiveStorageCounter() as counter:
            kept = load()
        peaks[how] = counter.peak
        del kept
    adapters = adapters_for(plan.config, plan.shape)
    nf4 = base_bytes(plan.shape, adapters, 4)[0]
    predicted = quantized_load_bytes(plan.shape, 1, 4, plan.strategy, adapters)
    print(f"{params / 1e6:.1f}M params, FSDP2 plan's CPU load, live tensors at the peak: old 16-bit path "
          f"{peaks['old'] / 2**20:.0f} MiB, quantized as it loads {peaks['new'] / 2**20:.0f} MiB (NF4 model "
          f"{nf4 / 2**20:.0f} MiB; planner's per-rank term {predicted / 2**20:.0f} MiB)")
    assert peaks["old"] >= 4 * params
    assert nf4 <= peaks["new"] < params  # the NF4 model is held; the 16-bit base never is
    assert peaks["new"] <= predicted * 1.05


def _setup_without_16bit_load(model_dir: str, run_dir: str) -> dict:
    import bitsandbytes as bnb

    from orchestrate.backends.registry import get_backend
    from orchestrate.loading import weights as loading
    from tests.helpers.dist import init_gloo

    rank, world = init_gloo()
    original, calls = loading.load_replicated, []
    loading.load_replicated = _no_16bit_load  # every caller imports it from the module at call time
    out = {}
    for backend in ("fsdp", "zero2", "zero3"):
        plan = _plan(backend, ARCHS["qwen2"])
        engine = setup_engine(get_backend(plan.strategy.backend), plan, cpu_rank(rank, world), model_dir)
        module = getattr(engine.model, "module", engine.model)
        out[backend] = sorted({str(m.weight.dtype) for m in module.modules() if isinstance(m, bnb.nn.Linear4bit)}
                              | {f"n={sum(isinstance(m, bnb.nn.Linear4bit) for m in module.modules())}"})
        del engine
    # LoRA (16-bit) under FSDP2: rank 0 alone reads the base; the others get their shards broadcast.
    loading.load_replicated = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    plan = make_plan(SHARDING["fsdp"], config={"model": {"architecture": dict(ARCHS["qwen2"])},
                                               "train": {"method": "lora"}})
    engine = setup_engine(get_backend("fsdp"), plan, cpu_rank(rank, world), model_dir)
    out["lora_reads"], out["lora_base"] = len(calls), _base_mismatches(engine.model, model_dir)
    return out


def _base_mismatches(model, model_dir: str) -> tuple[int, list[str]]:
    """(how many base tensors were compared, those whose gathered value is not the file's): a rank filled
    by the broadcast holds the real weights, not to_empty's garbage."""
    from safetensors.torch import load_file

    files = load_file(str(Path(model_dir) / "model.safetensors"))
    checked, wrong = 0, []
    for name, p in model.named_parameters():
        key = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if key in files:
            checked += 1
            if not torch.equal(p.full_tensor(), files[key].to(p.dtype)):  # collective: every rank, same order
                wrong.append(key)
    return checked, wrong


@pytest.mark.slow
def test_backends_setup_never_reads_the_16bit_base(tmp_path):
    """QLoRA under all three: no 16-bit read at all; LoRA under FSDP2: one, on rank 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers.dist import run_on_ranks

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**ARCHS["qwen2"])).save_pretrained(tmp_path / "m")
    out = run_on_ranks(_setup_without_16bit_load, 2, str(tmp_path / "m"), str(tmp_path / "run"))
    for rank, r in out.items():
        assert r["lora_reads"] == (1 if rank == 0 else 0), (rank, r)
        assert r["lora_base"] == (2 * 12 + 3, []), (rank, r)  # 12 per Qwen2 block, embed, norm, lm_head
        assert {b: r[b] for b in SHARDING} == {b: sorted({str(STORAGE[b]), "n=14"}) for b in SHARDING}, (rank, r)


@pytest.mark.parametrize(("backend", "stage"), [("fsdp", 3), ("deepspeed", 2), ("deepspeed", 3)])
def test_the_plan_charges_each_rank_the_nf4_base_and_one_tensor_not_the_16bit_base(backend, stage):
    """Llama-3-8B shape on 2 GPUs: the host while loading is 2 x (NF4 block linears at 4.127 bits + the rest
    in bf16 + the embedding read in fp32 and cast to bf16), where it was 2 x 2 B x P."""
    from orchestrate.methods.lora.adapters import adapters_for
    from orchestrate.methods.lora.method import adapter_terms
    from orchestrate.model.formulas import shape_from_dict
    from orchestrate.planner.memory import estimate_memory
    from tests.methods.lora.test_lora_plan import LLAMA3_8B
    from tests.unit.planner.test_memory_knobs import cfg
    from tests.unit.planner.test_memory_model import gpu_hw, strat

    shape = shape_from_dict(dict(LLAMA3_8B))
    a = adapters_for(cfg(LLAMA3_8B, method="qlora"), shape)
    mem = estimate_memory(shape, gpu_hw(gpus=2, ram_gib=128), strat(backend, stage, ac=True), 4096, 1, [adapter_terms(a, shape)])
    nf4 = a.quantized * 4.127 / 8 + (shape.parameters - a.quantized) * 2
    expected = 2 * (nf4 + (4 + 2) * 128256 * 4096)
    steady = sum(v for key, v in mem.cpu.items() if key not in ("loading_spike", "process_runtime"))
    assert mem.cpu["loading_spike"] == pytest.approx(max(0.0, expected - steady), rel=1e-3)
    # 16.5 GiB vs 29.9: the one tensor in flight is the 128k x 4096 embedding (2.9 GiB per rank as read + cast)
    assert mem.cpu["loading_spike"] + steady < 0.6 * 2 * 2 * shape.parameters


@pytest.mark.parametrize(("backend", "stage", "copies"), [("fsdp", 3, 1), ("deepspeed", 2, 2), ("deepspeed", 3, 2)])
def test_a_lora_base_is_planned_as_one_16bit_copy_under_fsdp_and_one_per_rank_under_deepspeed(backend, stage, copies):
    from orchestrate.methods.lora.adapters import adapters_for
    from orchestrate.methods.lora.method import adapter_terms
    from orchestrate.model.formulas import shape_from_dict
    from orchestrate.planner.memory import estimate_memory
    from tests.methods.lora.test_lora_plan import LLAMA3_8B
    from tests.unit.planner.test_memory_knobs import cfg
    from tests.unit.planner.test_memory_model import gpu_hw, strat

    shape = shape_from_dict(dict(LLAMA3_8B))
    a = adapters_for(cfg(LLAMA3_8B, method="lora"), shape)
    mem = estimate_memory(shape, gpu_hw(gpus=2, ram_gib=128), strat(backend, stage, ac=True), 4096, 1, [adapter_terms(a, shape)])
    steady = sum(v for key, v in mem.cpu.items() if key not in ("loading_spike", "process_runtime"))
    assert mem.cpu["loading_spike"] == pytest.approx(max(0.0, copies * 2 * shape.parameters - steady), rel=1e-3)
