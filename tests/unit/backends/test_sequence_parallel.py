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


def sp_plan(strategy: Strategy = SP_DDP, seq_len: int = LONG, ranks: int = 2, **train):
    return make_plan(strategy, ranks, config={"model": {"architecture": dict(LLAMA)},
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
    from tests.helpers.engines import builder, cpu_rank

    rank, world = init_gloo()
    plan = sp_plan()
    sequence = start_sequence_parallel(plan, rank, world)
    engine = DDPBackend().setup(plan, replace(cpu_rank(rank, world), sequence=sequence), Path(model_dir),
                                objective_for(plan, sequence=sequence), builder(plan))
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


def worker_plan(sequence_parallel: int, ranks: int, backend: str = "ddp", stage: int = 0, loss_chunks: int = 2,
                checkpointing: bool = False):
    """A run of the real worker: demo corpus, the loss in chunks, a checkpoint every 2 steps; one key/value
    head, which 2 sequence-parallel ranks each hold a copy of."""
    strategy = replace(Strategy(backend, stage, "none", "none", "fp32", checkpointing, 1), loss_chunks=loss_chunks,
                       sequence_parallel=sequence_parallel)
    return make_plan(strategy, ranks, config={
        "model": {"architecture": {**LLAMA, "num_key_value_heads": 1}}, "data": {"generate_demo_corpus": True},
        "train": {"seq_len": 512, "global_batch_size": 2, "max_steps": 4, "checkpoint_every": 2, "eval_batches": 2,
                  "optimizer": {"lr": 1e-2}, "schedule": {"warmup_steps": 1}, "report_to": ["none"]}})


def _run_worker(plan_path: str) -> int:
    """The worker on these ranks (`orchestrate.worker.main.train`), as torchrun starts it."""
    from orchestrate.worker.main import train
    from orchestrate.worker.signals import StopRequest

    return train(Path(plan_path), StopRequest())


def _records(path: Path) -> dict[int, dict]:
    import json

    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict[int, dict]:
    """The metrics of the worker's plain run on one rank (the reference of the sequence-parallel runs)."""
    from orchestrate.launch.rundir import prepare_run

    run_dir = tmp_path_factory.mktemp("plain")
    prepare_run(worker_plan(1, 1), run_dir)
    assert run_on_ranks(_run_worker, 1, str(run_dir / "plan.json")) == {0: 0}
    return _records(run_dir / "metrics.jsonl")


@pytest.mark.slow
def test_the_worker_trains_and_resumes_with_sequence_parallelism_as_one_rank_does(tmp_path, one_rank):
    """DDP, 2 ranks, one sequence-parallel group, through the worker's stages (data, engine, loop,
    evaluation, checkpoints): every step's loss and the eval loss equal a 1-rank run's on the same
    samples; resumed from step 2, steps 3 and 4 repeat bit for bit."""
    import shutil

    from orchestrate.launch.rundir import prepare_run
    from orchestrate.run.checkpoints import checkpoint_root, step_dir_name

    sp_dir = tmp_path / "sp"
    prepare_run(worker_plan(2, 2), sp_dir)
    assert run_on_ranks(_run_worker, 2, str(sp_dir / "plan.json")) == {0: 0, 1: 0}
    first = _records(sp_dir / "metrics.jsonl")
    shutil.rmtree(checkpoint_root(sp_dir) / step_dir_name(4))  # the newest left is step 2's: resumed from it
    assert run_on_ranks(_run_worker, 2, str(sp_dir / "plan.json")) == {0: 0, 1: 0}
    resumed, plain = _records(sp_dir / "metrics.jsonl"), one_rank
    for step in range(1, 5):
        print(f"step {step}: sequence-parallel {first[step]['loss']:.6f}, resumed {resumed[step]['loss']:.6f}, "
              f"1 rank {plain[step]['loss']:.6f}")
        assert first[step]["loss"] == pytest.approx(plain[step]["loss"], abs=TOLERANCE)
        assert first[step]["loss_tokens"] == plain[step]["loss_tokens"]
        assert resumed[step]["loss"] == first[step]["loss"]  # bit for bit, steps 3 and 4 recomputed
    assert first[4]["eval_loss"] == pytest.approx(plain[4]["eval_loss"], abs=TOLERANCE)
    assert resumed[4]["eval_loss"] == first[4]["eval_loss"]


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "stage", "loss_chunks", "checkpointing"),
                         [("fsdp", 3, 2, True), ("deepspeed", 3, 0, False)])
def test_sharding_backends_train_with_sequence_parallelism_as_one_rank_does(tmp_path, one_rank, backend, stage,
                                                                           loss_chunks, checkpointing):
    """FSDP2 (its blocks checkpointed: backward recomputes the all-to-alls) and DeepSpeed ZeRO-3 shard over
    both ranks of the sequence-parallel group: the worker's losses and eval loss equal the 1-rank run's
    (the chunked loss equals the whole one: test_chunked_loss)."""
    from orchestrate.launch.rundir import prepare_run

    prepare_run(worker_plan(2, 2, backend, stage, loss_chunks, checkpointing), tmp_path)
    assert run_on_ranks(_run_worker, 2, str(tmp_path / "plan.json")) == {0: 0, 1: 0}
    records = _records(tmp_path / "metrics.jsonl")
    for step in range(1, 5):
        print(f"step {step}: {backend} sequence-parallel {records[step]['loss']:.6f}, 1 rank {one_rank[step]['loss']:.6f}")
        assert records[step]["loss"] == pytest.approx(one_rank[step]["loss"], abs=TOLERANCE)
    assert records[4]["eval_loss"] == pytest.approx(one_rank[4]["eval_loss"], abs=TOLERANCE)


def test_sequence_parallelism_of_a_model_that_is_no_causal_lm_is_refused_before_anything_is_built():
    from orchestrate.backends.sequence_parallel import sequence_parallel_problems

    assert sequence_parallel_problems(sp_plan()) == []
    bert = make_plan(SP_DDP, config={"model": {"task": "masked-lm", "architecture": {
        "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 300}}, "train": {"seq_len": 64}})
    assert [p.where for p in sequence_parallel_problems(bert)] == ["train.sequence_parallel"]


def test_the_rendered_steps_say_how_sequences_are_split():
    from orchestrate.backends.ddp import ddp_settings
    from orchestrate.backends.fsdp import fsdp_settings

    for settings in (ddp_settings(sp_plan(seq_len=64)),
                     fsdp_settings(sp_plan(replace(SP_DDP, backend="fsdp", zero_stage=3), seq_len=64))):
        assert any("sequence parallelism over groups of 2" in step for step in settings["steps"])
    plain = ddp_settings(sp_plan(replace(SP_DDP, sequence_parallel=1), seq_len=64))
    assert not any("sequence parallelism" in step for step in plain["steps"])
