"""LoRA and QLoRA (NF4) training on 2 gloo ranks under DDP, on a tiny Llama-shaped model: the loss
falls, the frozen base stays bit-identical, checkpoints hold only the adapters and resume exactly,
RUN_DIR/adapter loads with peft and RUN_DIR/model (merged, fp32) gives the PEFT model's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrate.backends.ddp import DDPBackend
from orchestrate.methods.lora.saving import save_merged_and_adapter
from orchestrate.planner.strategy import Strategy
from orchestrate.run.layout import RunDir
from tests.helpers.dist import init_gloo, run_on_ranks
from tests.helpers.engines import cpu_rank, setup_engine
from tests.helpers.plans import make_plan

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 257, "max_position_embeddings": 64}
SEQ = 32
MERGE_TOLERANCE = {"lora": 1e-4, "qlora": 1e-2}
"""Max |logit difference| merged (fp32) vs PEFT model. lora: the same fp32 sums in another order.
qlora: bitsandbytes' CPU 4-bit path computes in bf16 once it has run a forward (its quant state then
dequantizes to bfloat16, seen here), so the PEFT model's matmuls round to bf16 (~3 significant
digits); measured 2.4e-3 on this model."""


def lora_plan(method: str):
    return make_plan(Strategy("ddp", 0, "none", "none", "fp32", False, 2), config={
        "model": {"architecture": dict(TINY_LLAMA)},
        "train": {"method": method, "lora": {"r": 8, "alpha": 16}, "max_steps": 8, "optimizer": {"lr": 2e-2},
                  "schedule": {"warmup_steps": 1}}})


def _batches(rank: int) -> list[dict[str, torch.Tensor]]:
    x = torch.randint(0, 257, (4, SEQ), generator=torch.Generator().manual_seed(1000 + rank))
    return [{"input_ids": t, "labels": t} for t in x.split(2)]


def _train(method: str, model_dir: str, run_dir: str) -> dict:
    rank, world = init_gloo()
    plan, run = lora_plan(method), Path(run_dir)
    engine = setup_engine(DDPBackend(), plan, cpu_rank(rank, world), model_dir)
    module = engine.model.module
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    losses = [engine.train_step(_batches(rank)).loss for _ in range(4)]
    engine.save_checkpoint(run / "ckpt", {"step": 4})
    losses += [engine.train_step(_batches(rank)).loss for _ in range(4)]
    same_base = all(torch.equal(p, frozen[n]) for n, p in module.named_parameters() if not p.requires_grad)
    save_merged_and_adapter(plan, engine, RunDir(run), rank == 0)  # run/model and run/adapter
    resumed = setup_engine(DDPBackend(), plan, cpu_rank(rank, world), model_dir)
    resumed.load_checkpoint(run / "ckpt")
    out = {"losses": losses, "same_base": same_base, "frozen": len(frozen),
           "resumed": [resumed.train_step(_batches(rank)).loss for _ in range(4)]}
    if rank == 0:
        out.update(_compare_outputs(method, module, model_dir, run))
    return out


def _compare_outputs(method: str, module, model_dir: str, run: Path) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    probe = torch.randint(0, 257, (2, SEQ), generator=torch.Generator().manual_seed(7))
    ckpt = torch.load(run / "ckpt" / "trainer_state.pt", weights_only=True)["model"]
    merged = AutoModelForCausalLM.from_pretrained(run / "model", dtype=torch.float32).eval()
    module.eval()
    with torch.no_grad():
        trained = module(input_ids=probe).logits
        out = {"ckpt_keys": sorted(ckpt), "merge_diff": (merged(input_ids=probe).logits - trained).abs().max().item()}
        if method == "lora":  # a full-precision base: the saved adapter on the initial weights is the model
            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            loaded = PeftModel.from_pretrained(base, run / "adapter").eval()
            out["adapter_diff"] = (loaded(input_ids=probe).logits - trained).abs().max().item()
        else:  # an NF4 base: the adapter still loads onto the full-precision base, as peft's loader does
            out["adapter_diff"] = None
            PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), run / "adapter")
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from orchestrate.loading.init_weights import build_initial_model

    return str(build_initial_model(lora_plan("lora"), tmp_path_factory.mktemp("m") / "llama"))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_ddp_trains_adapters_only_and_merges(method, model_dir, tmp_path):
    out = run_on_ranks(_train, 2, method, model_dir, str(tmp_path))
    for rank, r in out.items():
        assert r["losses"][-1] < r["losses"][0] - 0.2, f"rank {rank}: {r['losses']}"
        assert r["same_base"] and r["frozen"] > 0
        assert r["resumed"] == pytest.approx(r["losses"][4:], abs=1e-6)
    r0 = out[0]
    print(f"{method}: losses {r0['losses'][0]:.3f} -> {r0['losses'][-1]:.3f}, merged-vs-PEFT max |logit diff| "
          f"{r0['merge_diff']:.2e}, reloaded adapter {r0['adapter_diff']}")
    assert r0["ckpt_keys"] and all("lora_" in k for k in r0["ckpt_keys"])
    assert r0["merge_diff"] < MERGE_TOLERANCE[method], r0["merge_diff"]
    if method == "lora":
        assert r0["adapter_diff"] < MERGE_TOLERANCE[method], r0["adapter_diff"]


def test_exporting_an_adapter_checkpoint_needs_merge_and_merge_needs_adapters(tmp_path):
    from orchestrate.errors import UserError
    from orchestrate.export import _check_merge

    with pytest.raises(UserError, match="adapters only") as err:
        _check_merge(lora_plan("qlora"), tmp_path, merge=False)
    assert "--merge" in err.value.problems[0].fix
    with pytest.raises(UserError, match="nothing to merge") as err:
        _check_merge(make_plan(Strategy("ddp", 0, "none", "none", "fp32", False, 2)), tmp_path, merge=True)
    assert err.value.problems[0].where == "--merge"
    _check_merge(lora_plan("lora"), tmp_path, merge=True)  # the one way to export an adapter run
