"""The analytical model's model-state terms against what real 2-rank gloo runs hold, per rank.

Tiny GPT-2 (tests/helpers/plans.py), bf16, two training steps on two gloo ranks, built and wrapped
exactly as the simulation does (`orchestrate.simulate.harness.Trainer`, which follows the backends).
After the second backward the gradients are read; while the wrapped optimizer steps, the fp32
gradients it steps with; after the step the parameters, fp32 master copies and Adam states. Bytes
are those of the distinct storages held (what the allocator gives out), so padding is included.

Each term must equal the analytical one up to the padding the frameworks add, which the tests
compute from the framework's own rule instead of guessing a percentage:
- DeepSpeed ZeRO-1/2 pad the flat 16-bit buffer to a multiple of 2 x world size elements
  (stage_1_and_2.py: `nccl_start_alignment_factor * dp_size`) and partition it evenly;
- ZeRO-3 partitions every parameter on its own, ceil(numel / world) elements per rank (stage3.py /
  partition_parameters.py);
- FSDP2 shards each parameter on dim 0 into world-many chunks of ceil(dim0 / world) rows, the
  sharded storage padded to that size on every rank (_fsdp_param.py, `_init_sharded_param`).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from orchestrate.planner.strategy import Strategy
from orchestrate.simulate.run_spec import RunSpec, spec_from_plan
from tests.helpers.plans import make_plan

WORLD = 2
TERMS = ("weights", "master_weights", "gradients", "optimizer_states")


def _strategy(backend: str, stage: int) -> Strategy:
    return Strategy(backend=backend, zero_stage=stage, offload_optimizer="none", offload_params="none",
                    precision="bf16", activation_checkpointing=False, micro_batch_size=2)


# (strategy, gradient accumulation): ZeRO-1 keeps whole 16-bit gradients only between micro-batches.
CASES = [(_strategy("deepspeed", 1), 1), (_strategy("deepspeed", 1), 2), (_strategy("deepspeed", 2), 2),
         (_strategy("deepspeed", 3), 2), (_strategy("fsdp", 3), 2)]


def _plan(strategy: Strategy, accumulation: int):
    batch = strategy.micro_batch_size * WORLD * accumulation
    return make_plan(strategy, ranks=WORLD, config={"train": {"global_batch_size": batch}})


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views into one buffer count once)."""
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
    return sum(seen.values())


def _measure(spec_dicts: list[dict]) -> list[dict]:
    """Per spec, on this rank: bytes held by kind (module level: spawned by run_on_ranks)."""
    import torch
    from torch.distributed.tensor import DTensor

    from orchestrate.simulate.harness import Trainer, make_mesh
    from orchestrate.simulate.patches import cuda_like_dropout
    from tests.helpers.dist import init_gloo

    rank, _ = init_gloo()
    out = []
    for data in spec_dicts:
        spec = dataclasses.replace(RunSpec.from_dict(data), rank=rank)
        with cuda_like_dropout():
            trainer = Trainer(spec, None, make_mesh(spec))
            trainer.step()
            low_grads = 0
            for i in range(spec.gradient_accumulation):  # the 16-bit gradients held after each backward
                trainer.forward_backward(i)
                low_grads = max(low_grads, _storage_bytes(trainer.state_tensors()["gradients"]))
            # The wrapped torch AdamW is handed the gradients it steps with (DeepSpeed: the fp32
            # gradient partition it creates for the step; FSDP2: the sharded gradients above).
            inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
            stepped: list = []
            orig_step = inner.step

            def step(*args, _orig=orig_step, _inner=inner, _out=stepped, **kwargs):
                _out.extend(p.grad for g in _inner.param_groups for p in g["params"] if p.grad is not None)
                return _orig(*args, **kwargs)

            inner.step = step
            trainer.optimizer_step()
            state = trainer.state_tensors()
        stepped = [g._local_tensor if isinstance(g, DTensor) else g for g in stepped]
        step_grads = _storage_bytes(stepped)
        adam = [t for t in state["optimizer_states"] if t.ndim > 0]  # exp_avg, exp_avg_sq; not `step`
        out.append({
            "weights": _storage_bytes(state["parameters"]),
            "master_weights": _storage_bytes(state["master_weights"]),
            # FSDP2 steps the very sharded gradients read after backward: count them once.
            "gradients": low_grads + (0 if spec.strategy["backend"] == "fsdp" else step_grads),
            "optimizer_states": _storage_bytes(adam),
            "optimizer_state_dtypes": sorted({str(t.dtype) for t in adam}),
        })
        del trainer, state, stepped
        torch.distributed.barrier()
    return out


def _padding_bound(strategy: Strategy, shapes: list[tuple[int, ...]], n: int) -> int:
    """Elements per rank one partition may exceed P / n by, from the framework's padding rule."""
    if strategy.backend == "fsdp":
        return sum(math.ceil(s[0] / n) * math.prod(s[1:]) - math.prod(s) / n for s in shapes)
    if strategy.zero_stage == 3:
        return sum(math.ceil(math.prod(s) / n) - math.prod(s) / n for s in shapes)
    return 2  # a flat buffer padded to a multiple of 2n, split n ways


def _predicted(strategy: Strategy, plan) -> dict[str, int]:
    from orchestrate.planner.memory import _placement

    # The held sizes, before estimate_memory nets what exists only in backward against the
    # activations freed before it grows (memory.py, "Peak model"), which is no held size.
    gpu = _placement(plan.shape, plan.hardware, strategy, plan.chosen.gradient_accumulation).gpu
    return {k: gpu.get(k, 0) for k in TERMS}


@pytest.fixture(scope="module")
def measured():
    from tests.helpers.dist import run_on_ranks

    plans = [_plan(s, ga) for s, ga in CASES]
    specs = [spec_from_plan(p) for p in plans]
    assert [s.gradient_accumulation for s in specs] == [ga for _, ga in CASES]
    per_rank = run_on_ranks(_measure, WORLD, [s.to_dict() for s in specs])
    return plans, per_rank


def _bounds(strategy: Strategy, plan, predicted: dict[str, int]) -> dict[str, tuple[float, float]]:
    """Allowed [low, high] measured bytes per term: the prediction +- padding elements x bytes per
    element, and for DeepSpeed's partitioned 16-bit gradients the one rule that is a bound, not a size."""
    from orchestrate.model.meta import build_meta_model, load_model_config

    model = build_meta_model(load_model_config(plan.config))
    shapes = [tuple(p.shape) for p in model.parameters()]
    pad = _padding_bound(strategy, shapes, WORLD)
    if strategy.backend == "fsdp":  # fp32 shards, fp32 sharded grads, 2 fp32 Adam states
        slack = {"weights": 4 * pad, "master_weights": 0, "gradients": 4 * pad, "optimizer_states": 8 * pad}
    else:
        low = 2 * (WORLD * pad if strategy.zero_stage < 3 else pad)  # ZeRO-1/2 hold the whole flat buffer
        slack = {"weights": low, "master_weights": 4 * pad, "gradients": 2 * pad + 4 * pad,
                 "optimizer_states": 8 * pad}
    bounds = {t: (predicted[t] - slack[t], predicted[t] + slack[t]) for t in TERMS}
    partitioned_low_grads = strategy.backend == "deepspeed" and (
        strategy.zero_stage == 2 or (strategy.zero_stage == 1 and plan.chosen.gradient_accumulation == 1))
    if partitioned_low_grads:
        # grads_in_partition holds the whole parameters overlapping the partition: P/n plus at most
        # one parameter, which the model bounds by the largest layer (memory.py). Measured must lie
        # between the bare partition and that bound.
        extra = 2 * plan.shape.largest_layer_parameters
        lo, hi = bounds["gradients"]
        bounds["gradients"] = (lo - extra, hi)
    return bounds


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{s.name}-ga{ga}" for s, ga in CASES])
def test_model_state_terms_match_a_real_run(measured, index):
    plans, per_rank = measured
    strategy, plan = CASES[index][0], plans[index]
    predicted = _predicted(strategy, plan)
    bounds = _bounds(strategy, plan, predicted)
    report = []
    for rank in range(WORLD):
        got = per_rank[rank][index]
        assert got["optimizer_state_dtypes"] == ["torch.float32"]
        for term in TERMS:
            lo, hi = bounds[term]
            if not lo <= got[term] <= hi:
                report.append(f"rank {rank} {term}: predicted {predicted[term]:,} B, measured {got[term]:,} B "
                              f"(allowed {lo:,.0f}..{hi:,.0f} B)")
    header = f"{strategy.name}, accumulation {plan.chosen.gradient_accumulation}, P = {plan.shape.parameters:,}"
    assert not report, header + ":\n" + "\n".join(report)
