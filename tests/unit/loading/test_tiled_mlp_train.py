"""The tiled MLP (`Strategy.mlp_tiles`) trains on 2 gloo ranks under every engine that lists it in its
`knobs`: DDP, FSDP2 and DeepSpeed ZeRO-2/3, full fine-tuning and LoRA, with and without activation
checkpointing, give the untiled run's losses (fp32, 1e-5), and a DDP run resumes from its checkpoint
bit-exact. Tiny Llama with a wide MLP; 100 tokens in 3 slices of 34, 34 and 32."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from orchestrate.backends.registry import runs_knob
from orchestrate.planner.strategy import Strategy
from tests.helpers.dist import init_gloo, run_on_ranks
from tests.helpers.plans import make_plan

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 352, "vocab_size": 257, "max_position_embeddings": 128}
SEQ, TILES, STEPS = 100, 3, 3
# (backend, zero stage, method, activation checkpointing)
TORCH_CASES = [("ddp", 0, "full", True), ("ddp", 0, "lora", False), ("fsdp", 3, "full", True), ("fsdp", 2, "lora", False)]
DEEPSPEED_CASES = [("deepspeed", 2, "full", False), ("deepspeed", 2, "lora", True), ("deepspeed", 3, "lora", False),
                   ("deepspeed", 3, "full", True)]


def _plan(case: tuple, tiles: int):
    backend, stage, method, checkpointing = case
    strategy = replace(Strategy(backend, stage, "none", "none", "fp32", checkpointing, 1), mlp_tiles=tiles)
    return make_plan(strategy, config={
        "model": {"architecture": dict(LLAMA)},
        "train": {"method": method, "lora": {"r": 8, "alpha": 16}, "seq_len": SEQ, "global_batch_size": 4,
                  "max_steps": 2 * STEPS, "optimizer": {"lr": 5e-3}, "schedule": {"warmup_steps": 1}}})


def _batches(rank: int) -> list[dict[str, torch.Tensor]]:
    x = torch.randint(0, 257, (2, SEQ), generator=torch.Generator().manual_seed(1000 + rank))
    return [{"input_ids": t, "labels": t} for t in x.split(1)]


def _train(cases: list[tuple], model_dir: str, run_dir: str) -> dict:
    from orchestrate.backends.registry import get_backend
    from tests.helpers.engines import cpu_rank, setup_engine

    rank, world = init_gloo()
    # Every plan before any engine: a ZeRO-3 engine's live HfDeepSpeedConfig would make the plans' meta
    # builds zero.Init ones.
    plans = {(case, tiles): _plan(case, tiles) for case in cases for tiles in (0, TILES)}
    out = {}
    for (case, tiles), plan in plans.items():
        engine = setup_engine(get_backend(case[0]), plan, cpu_rank(rank, world), model_dir)
        out[case, tiles] = [engine.train_step(_batches(rank)).loss for _ in range(STEPS)]
        if case[0] == "ddp" and case[2] == "full" and tiles:
            ckpt = Path(run_dir) / "ckpt"
            engine.save_checkpoint(ckpt, {"step": STEPS})
            after = [engine.train_step(_batches(rank)).loss for _ in range(2)]
            resumed = setup_engine(get_backend("ddp"), plan, cpu_rank(rank, world), model_dir)
            resumed.load_checkpoint(ckpt)
            out["resume"] = {"continued": after, "resumed": [resumed.train_step(_batches(rank)).loss for _ in range(2)]}
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from orchestrate.loading.init_weights import build_initial_model

    return str(build_initial_model(_plan(TORCH_CASES[0], 0), tmp_path_factory.mktemp("m") / "llama"))


def _check(out: dict[int, dict], cases: list[tuple]) -> None:
    for rank, result in out.items():
        for case in cases:
            plain, tiled = result[case, 0], result[case, TILES]
            print(f"rank {rank} {case}: untiled {plain}, {TILES} tiles {tiled}")
            assert tiled == pytest.approx(plain, rel=1e-5, abs=1e-5), case
            assert plain[-1] < plain[0], case  # it trains


@pytest.mark.slow
def test_ddp_and_fsdp2_train_tiled_mlps_as_the_untiled_ones_and_resume_exactly(model_dir, tmp_path):
    assert all(runs_knob(backend, "mlp_tiles") for backend in ("ddp", "fsdp"))
    out = run_on_ranks(_train, 2, TORCH_CASES, model_dir, str(tmp_path))
    _check(out, TORCH_CASES)
    for rank, result in out.items():
        assert result["resume"]["resumed"] == result["resume"]["continued"], rank


@pytest.mark.slow
def test_deepspeed_zero2_and_zero3_train_tiled_mlps_as_the_untiled_ones(model_dir, tmp_path):
    assert runs_knob("deepspeed", "mlp_tiles")
    _check(run_on_ranks(_train, 2, DEEPSPEED_CASES, model_dir, str(tmp_path)), DEEPSPEED_CASES)
