"""The sharded teacher on 2 gloo ranks (slow): FSDP2 shards hold what the planner's
`teacher_weights` term says, its logits are the replicated teacher's, and it stays frozen."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.dist import init_gloo, run_on_ranks
from tests.helpers.plans import make_plan
from tests.methods.distill.test_distill import GPT2
from tests.unit.planner.test_memory_model import strat


def _plan(teacher: str):
    return make_plan(strat("fsdp", 3, precision="fp32", micro=2), ranks=2,
                     config={"distill": {"teacher": teacher, "placement": "sharded"}})


def _on_rank(teacher: str) -> dict:
    from torch.distributed.tensor import DTensor

    from orchestrate.methods.distill.runtime import build_teacher, teacher_placement

    init_gloo()
    plan, cpu = _plan(teacher), torch.device("cpu")
    placement = teacher_placement(plan, cpu, 2)
    sharded = build_teacher(plan, cpu, 2, placement)
    replicated = build_teacher(plan, cpu, 2, "replicated")
    local = sum(p.to_local().numel() * p.element_size() for p in sharded.parameters() if isinstance(p, DTensor))
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (sharded(input_ids=ids).logits - replicated(input_ids=ids).logits).abs().max().item()
    return {"placement": placement, "local_bytes": local, "diff": diff, "training": sharded.training,
            "trainable": sum(p.requires_grad for p in sharded.parameters())}


@pytest.mark.slow
def test_sharded_teacher_holds_its_planned_shard_and_matches_the_replicated_one(tmp_path: Path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from orchestrate.methods.distill.memory import teacher_model
    from orchestrate.methods.distill.method import distill_terms
    from orchestrate.model.formulas import shape_from_dict
    from orchestrate.planner.memory import estimate_memory

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(**GPT2)).save_pretrained(tmp_path / "teacher")
    results = run_on_ranks(_on_rank, 2, str(tmp_path / "teacher"))
    plan = _plan(str(tmp_path / "teacher"))
    shape = shape_from_dict(dict(GPT2))
    predicted = estimate_memory(shape, plan.hardware, plan.strategy, 32, 1,
                                [distill_terms(teacher_model(shape, "sharded", 16))]).gpu["teacher_weights"]
    for rank, r in results.items():
        assert r["placement"] == "sharded" and not r["training"] and r["trainable"] == 0, r
        assert r["diff"] < 1e-5, r  # the same fp32 weights, gathered
        # FSDP2 pads each tensor's first dimension to a multiple of the world size: at most a row each.
        assert r["local_bytes"] == pytest.approx(predicted, rel=0.01), (rank, r["local_bytes"], predicted)
