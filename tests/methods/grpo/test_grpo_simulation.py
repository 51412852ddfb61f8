"""`orchestrate plan --simulate` of a GRPO plan: the fake-tensor harness runs the rollout phase
(methods/grpo/simulation.py: HF generate to max_completion_length on the gathered weights, then the
scoring forwards) before each training micro-batch of num_generations rows, and the simulated per-rank
peak is set against the plan's. Scaled-down Llama shapes on CPU ranks (fp32):

- DDP, one rank, the training phase the peak: within 5 % (the plan's attention mask of padded rows is
  the one term the simulation cannot see: its rows are unpadded, so it is reported unseen);
- FSDP2 full shard, two ranks, the rollout phase the peak (the whole model gathered once for sampling):
  the plan is high, never low, by at most 20 %: it keeps the training step's own gathered blocks beside
  the rollout's whole gathered model (memory.py `gathered_weight_bytes`, predicted high on purpose)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from orchestrate import api
from orchestrate.simulate.run_spec import spec_from_plan
from orchestrate.simulate.verify import verify_plan
from tests.helpers.plans import cpu_hardware

pytestmark = pytest.mark.slow  # two simulations of 20-40 s each, side by side


def _plan(tmp_path, name: str, architecture: dict, seq_len: int, completion: int, generations: int, strategy: dict,
          ranks: int):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a"}\n')
    config = {"model": {"architecture": {"model_type": "llama", "max_position_embeddings": seq_len, **architecture}},
              "train": {"method": "full", "seq_len": seq_len, "global_batch_size": ranks, "micro_batch_size": 1},
              "data": {"train_files": [str(tmp_path / "prompts.jsonl")]}, "strategy": strategy,
              "grpo": {"num_generations": generations, "max_completion_length": completion,
                       "rewards": [{"kind": "format", "pattern": "x"}]}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    plan = api.plan_from_file(path, [], cpu_hardware(ranks))
    assert api.is_runnable(plan), plan
    return plan


def test_plan_simulate_runs_both_phases_and_agrees_with_the_plan(tmp_path):
    training_bound = _plan(tmp_path, "ddp", {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                                             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512},
                           128, 32, 8, {"backend": "ddp"}, 1)
    rollout_bound = _plan(tmp_path, "fsdp", {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
                                             "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 4000},
                          16, 12, 4, {"backend": "fsdp", "zero_stage": 3}, 2)
    spec = spec_from_plan(training_bound)
    assert spec.rows == 8 and [p["name"] for p in spec.phases] == ["rollout"]
    with ThreadPoolExecutor(2) as pool:
        ddp, fsdp = pool.map(verify_plan, [training_bound, rollout_bound])
    print(ddp.summary(), fsdp.summary(), sep="\n")  # docs/grpo.md quotes these (pytest -s)

    assert ddp.simulation.breakdown.get("rollout", 0) > 0  # the kept rollouts, born in the rollout phase
    assert set(ddp.unseen_bytes) == {"attention_mask"}
    assert ddp.analytical_over_simulated == pytest.approx(1.0, abs=0.05), ddp.summary()

    whole_model = 4 * rollout_bound.shape.parameters  # fp32, every weight gathered for sampling
    assert fsdp.simulation.breakdown["gathered_params"] == pytest.approx(whole_model, rel=0.01), fsdp.summary()
    assert 1.0 <= fsdp.analytical_over_simulated <= 1.20, fsdp.summary()
