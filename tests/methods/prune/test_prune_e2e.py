"""A whole `orchestrate launch` with `prune:` on 2 gloo ranks (DDP): the pruning callback is wired
into the worker's loop, every metrics.jsonl record carries the measured sparsity, and the saved
structured model (MLP channels and query heads) is physically smaller with the plan's predicted
parameter count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrate.launch.rundir import prepare_run
from orchestrate.launch.session import start
from orchestrate.planner.report import plan_json
from orchestrate.planner.strategy import Strategy
from orchestrate.planning import method_reports
from orchestrate.transports.local.transport import LocalTorchrun
from tests.helpers.plans import make_plan
from tests.methods.prune.test_prune_train import TINY_LLAMA


@pytest.mark.slow
def test_launch_with_structured_pruning_records_sparsity_and_saves_the_smaller_model(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    plan = make_plan(Strategy("ddp", 0, "none", "none", "fp32", False, 4), ranks=2, source_dir=tmp_path, config={
        "model": {"architecture": dict(TINY_LLAMA)},
        "train": {"max_steps": 6, "optimizer": {"lr": 5e-3}, "schedule": {"warmup_steps": 1}, "report_to": ["none"]},
        "data": {"generate_demo_corpus": True},
        "prune": {"method": "structured", "scope": "per-layer", "target_sparsity": 0.5, "heads": True,
                  "schedule": {"start_step": 1, "end_step": 4, "every": 1}}})
    run_dir = tmp_path / "run"
    assert start(prepare_run(plan, run_dir), run_dir.resolve(), LocalTorchrun()).exit_code == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print("sparsity", [(r["step"], round(r["sparsity"], 4), round(r["sparsity_target"], 4)) for r in records])
    assert [r["step"] for r in records] == list(range(1, 7))
    # 64 of 128 channels and 1 of the 2 query heads per key/value head, from step 4 on
    assert records[0]["sparsity"] == 0.0 and [r["sparsity"] for r in records[3:]] == [0.5] * 3
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    predicted = plan_json(plan, method_reports(plan))["prune"]  # what `orchestrate plan --json` says the run saves
    assert model.config.intermediate_size == predicted["saved_intermediate_size"] == 64
    assert model.config.num_attention_heads == predicted["saved_num_attention_heads"] == 2
    assert model.num_parameters() == predicted["saved_parameters"] < plan.shape.parameters
