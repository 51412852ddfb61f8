"""The merged model of an adapter run scores on held-out data what the run's own evaluation measured,
with evaluations between training steps (as `train.eval_every` runs them): LoRA and QLoRA under DDP,
FSDP2 and DeepSpeed, on 2 gloo ranks, tiny Llama- and Qwen2-shaped models (Qwen2's projections carry
a bias).

What it protects: a 4-bit base comes through evaluation as it went in. bitsandbytes' CPU `Linear4bit`
rewrites its weight into another layout on an eval-mode forward without grad (see
orchestrate/methods/lora/transform.py `nf4_linear`); the merge then decoded the rewritten bytes, FSDP2 decoded the
re-gathered plain bytes with the rewritten quant state (a wrong eval loss, then wrong training), and
models with biased projections crashed in the next training step. Evaluation under FSDP2 must also
measure what DDP measures for the same weights and data.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrate.methods.lora.saving import save_merged_and_adapter
from orchestrate.planner.strategy import Strategy
from orchestrate.run.layout import RunDir
from tests.helpers.dist import init_gloo, run_on_ranks
from tests.helpers.engines import cpu_rank, setup_engine
from tests.helpers.plans import make_plan
from tests.methods.lora.test_lora_backends import BACKENDS, FAMILIES, SEQ

STRATEGIES = {**BACKENDS, "ddp": Strategy("ddp", 0, "none", "none", "fp32", False, 2)}
EVAL_AFTER = (3, 8)
"""Evaluate after these steps; the run ends after the last one."""
AGREE = 1e-4
"""|merged model's loss - last eval loss|, and |FSDP2 eval loss - DDP eval loss|: the same fp32
weights summed in another order (measured up to 2e-7)."""


def _sequences(offsets: range) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of 2 of a learnable pattern (counting mod 17 from each offset)."""
    x = torch.stack([(torch.arange(SEQ) + o) % 17 for o in offsets])
    return [{"input_ids": t, "labels": t} for t in x.split(2)]


HELD_OUT = range(4)
"""Offsets no rank trains on (ranks train on 4..11)."""


def _plan(backend: str, method: str, family: str):
    return make_plan(STRATEGIES[backend], config={
        "model": {"architecture": dict(FAMILIES[family])},
        "train": {"method": method, "lora": {"r": 8, "alpha": 16}, "max_steps": EVAL_AFTER[-1],
                  "optimizer": {"lr": 2e-2}, "schedule": {"warmup_steps": 1}}})


def _run(cases: list[tuple[str, str, str]], model_dirs: dict[str, str], run_root: str) -> dict:
    """Each case: train, evaluate after the steps of EVAL_AFTER, save RUN_DIR/model; rank 0 scores it."""
    from transformers import AutoModelForCausalLM

    from orchestrate.backends.registry import get_backend
    from orchestrate.worker.objective import CausalLMObjective

    rank, world = init_gloo()
    train = _sequences(range(4 + 4 * rank, 8 + 4 * rank))
    out = {}
    for backend, method, family in cases:
        plan, run = _plan(backend, method, family), Path(run_root) / f"{backend}-{method}-{family}"
        engine = setup_engine(get_backend(plan.strategy.backend), plan, cpu_rank(rank, world), model_dirs[family])
        losses, evals = [], []
        for step in range(1, EVAL_AFTER[-1] + 1):
            losses.append(engine.train_step(train).loss)
            if step in EVAL_AFTER:  # each rank evaluates the same batches: no reduction needed
                evals.append(sum(engine.eval_sums(b)["loss"] for b in _sequences(HELD_OUT)) / 2)
        save_merged_and_adapter(plan, engine, RunDir(run), rank == 0)  # run/model: the merged model
        del engine
        result = {"losses": losses, "evals": evals}
        if rank == 0:
            merged = AutoModelForCausalLM.from_pretrained(run / "model", dtype=torch.float32).eval()
            with torch.no_grad():
                result["merged"] = sum(CausalLMObjective().eval_sums(merged, b)["loss"]
                                       for b in _sequences(HELD_OUT)) / 2
        out[(backend, method, family)] = result
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    from orchestrate.loading.init_weights import build_initial_model

    root = tmp_path_factory.mktemp("m")
    return {f: str(build_initial_model(_plan("fsdp", "lora", f), root / f)) for f in FAMILIES}


# One process launch per group (a launch costs more than a case); FSDP2 with DDP to compare with.
GROUPS = {"qlora-llama": [("ddp", "qlora", "llama"), ("fsdp", "qlora", "llama"), ("zero2", "qlora", "llama")],
          "qlora-qwen2": [("ddp", "qlora", "qwen2"), ("fsdp", "qlora", "qwen2"), ("zero3", "qlora", "qwen2")],
          "lora": [("ddp", "lora", "qwen2"), ("fsdp", "lora", "qwen2"), ("zero3", "lora", "llama")]}


@pytest.mark.slow
@pytest.mark.parametrize("group", list(GROUPS))
def test_the_merged_model_scores_what_evaluation_logged(group, model_dirs, tmp_path):
    out = run_on_ranks(_run, 2, GROUPS[group], model_dirs, str(tmp_path))[0]
    for (backend, method, family), r in out.items():
        label = f"{backend} {method} {family}"
        print(f"{label}: train loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, eval {r['evals']}, "
              f"merged model {r['merged']:.6f}")
        assert r["evals"][-1] < r["evals"][0] - 0.1, f"{label}: the adapters did not learn: {r['evals']}"
        assert r["merged"] == pytest.approx(r["evals"][-1], abs=AGREE), label
    ddp, fsdp = (next(r for (b, _, _), r in out.items() if b == name) for name in ("ddp", "fsdp"))
    assert fsdp["evals"] == pytest.approx(ddp["evals"], abs=AGREE)
    assert fsdp["losses"] == pytest.approx(ddp["losses"], abs=AGREE)
