"""Ulysses sequence parallelism (Strategy.sequence_parallel) computes what one rank computes: on 2 gloo
ranks, each holding half of a 16,384-token sequence of a small Llama (GQA), the loss and every parameter
gradient under DDP equal a plain 1-rank run on the whole sequence; a rank's slice keeps its targets across the cut and the global positions."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from orchestrate.data.sequence_slices import sequence_slice
from orchestrate.planner.strategy import Strategy
from tests.helpers.dist import init_gloo, run_on_ranks
from tests.helpers.plans import make_plan

LONG = 16384
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 257, "max_position_embeddings": LONG}
SP_DDP = replace(Strategy("ddp", 0, "none", "none", "fp32", False, 1), sequence_parallel=2)
TOLERANCE = 1e-5


def sp_plan(strategy: Strategy = SP_DDP, seq_len: int = LONG, **train):
    return make_plan(strategy, config={"model": {"architecture": dict(LLAMA)},
                                       "train": {"seq_len": seq_len, "global_batch_size": 1, **train}})


def test_a_slice_keeps_its_targets_across_the_cut_and_global_positions():
    tokens = torch.arange(8).reshape(1, 8)
    labels = tokens.clone()
    labels[0, 3] = -100
    first, second = (sequence_slice({"input_ids": tokens, "labels": labels}, i, 2) for i in (0, 1))
    assert first["input_ids"].tolist() == [[0, 1, 2, 3]] and second["input_ids"].tolist() == [[4, 5, 6, 7]]
    assert first["shift_labels"].tolist() == [[1, 2, -100, 4]]  # position 3 predicts token 4, the next slice's
    assert second["shift_labels"].tolist() == [[5, 6, 7, -100]]
    assert second["position_ids"].tolist() == [[4, 5, 6, 7]]
    with pytest.raises(ValueError, match="equal slices"):
        sequence_slice({"input_ids": tokens[:, :7], "labels": labels[:, :7]}, 0, 2)


def _loss_and_grads(model, objective, batch) -> tuple[float, dict[str, torch.Tensor]]:
    loss = objective.loss(model, batch)
    loss.backward()
    module = getattr(model, "module", model)
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _sp_vs_plain(model_dir: str) -> dict:
    from orchestrate.backends.ddp import DDPBackend
    from orchestrate.backends.sequence_parallel import start_sequence_parallel, use_ulysses_attention
    from orchestrate.worker.objective import CausalLMObjective, objective_for
    from tests.helpers.engines import cpu_rank

    rank, world = init_gloo()
    plan = sp_plan()
    sequence = start_sequence_parallel(plan, rank, world)
    engine = DDPBackend().setup(plan, replace(cpu_rank(rank, world), sequence=sequence), Path(model_dir),
                                objective_for(plan, sequence=sequence))
    plain = copy.deepcopy(engine.model.module)  # the same weights, the model's own attention
    use_ulysses_attention(engine.model, sequence, 1)
    tokens = torch.randint(0, LLAMA["vocab_size"], (1, LONG), generator=torch.Generator().manual_seed(7))
    labels = tokens.clone()
    labels[0, : LONG // 8] = -100  # a prompt: the slices carry different token counts
    sample = {"input_ids": tokens, "labels": labels}
    out = {"sp": _loss_and_grads(engine.model, engine.objective, sequence_slice(sample, sequence.index, 2))}
    if rank == 0:
        out["plain"] = _loss_and_grads(plain, CausalLMObjective(), sample)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from orchestrate.loading.init_weights import build_initial_model

    return str(build_initial_model(sp_plan(), tmp_path_factory.mktemp("m") / "llama"))


@pytest.mark.slow
def test_ddp_sequence_parallel_loss_and_gradients_equal_one_rank_on_the_whole_sequence(model_dir):
    out = run_on_ranks(_sp_vs_plain, 2, model_dir)
    plain_loss, plain_grads = out[0]["plain"]
    for rank, result in out.items():
        loss, grads = result["sp"]
        worst = max(float((grads[n] - g).abs().max()) for n, g in plain_grads.items())
        print(f"rank {rank}: loss {loss:.6f} (plain {plain_loss:.6f}), largest gradient difference {worst:.2e}")
        assert loss == pytest.approx(plain_loss, abs=TOLERANCE)
        assert grads.keys() == plain_grads.keys()
        for name, g in plain_grads.items():
            torch.testing.assert_close(grads[name], g, atol=TOLERANCE, rtol=0, msg=name)
