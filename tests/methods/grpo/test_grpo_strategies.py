"""GRPO under the sharded strategies on 2 gloo ranks (slow): FSDP2 full shard and shard-grad-op,
DeepSpeed ZeRO-2 and ZeRO-3, each sampling its own prompts' completions with the weights gathered
once per rollout phase (orchestrate/methods/grpo/gather.py), then training on them: the steps train
(non-zero losses and gradients), the metrics are TRL's, the model is saved, and every step samples
the same completions and takes the same loss as under DDP. Under ZeRO-3 LoRA with
beta > 0 scores the reference with the adapters disabled on the gathered weights. How often the
rollout gathers: test_grpo_gather.py."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_fault_tolerance import _launch, _metrics

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo"
REWARDS = [{"kind": "format", "pattern": "[aeiou]"}, {"kind": "exact_match", "column": "answer", "pattern": "^([^\\n]*)"}]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("grpo-strategies")
    train, held = runpy.run_path(str(EXAMPLE / "make_prompts.py"))["make"](64, 8, 0)
    for name, rows in (("prompts.jsonl", train), ("held_out.jsonl", held)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _run(root: Path, name: str, strategy: dict, train: dict | None = None, **grpo) -> Path:
    config = yaml.safe_load((EXAMPLE / "model.yaml").read_text())
    config["train"].update(max_steps=3, eval_every=3, output_dir=str(root), global_batch_size=4,
                           micro_batch_size=1, **(train or {}))
    config["data"].update(train_files=[str(root / "prompts.jsonl")], validation_files=[str(root / "held_out.jsonl")])
    config["grpo"].update(rewards=REWARDS, **grpo)
    config["strategy"] = strategy
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    code, out = _launch(path, root / name)
    assert code == 0, out[-3000:]
    return root / name


def _trained(run_dir: Path, backend: str, zero_stage: int) -> list[dict]:
    plan = json.loads((run_dir / "plan.json").read_text())["chosen_candidate"]["strategy"]
    assert (plan["backend"], plan["zero_stage"]) == (backend, zero_stage)
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all("reward" in r and "frac_reward_zero_std" in r and "completions/mean_length" in r for r in records)
    assert any(r["grad_norm"] > 0 and r["loss"] != 0 for r in records)  # the advantages were not all 0
    assert "eval_reward" in records[-1]
    return records


@pytest.fixture(scope="module")
def ddp(prompts) -> list[dict]:
    return _trained(_run(prompts, "ddp", {"backend": "ddp"}), "ddp", 0)


@pytest.mark.parametrize(("backend", "zero_stage"), [("fsdp", 3), ("fsdp", 2), ("deepspeed", 2), ("deepspeed", 3)])
def test_full_fine_tuning_samples_and_trains_under_each_sharded_strategy_as_under_ddp(prompts, ddp, backend,
                                                                                      zero_stage):
    """Same seed, fp32: the same completions sampled (the same rewards and lengths), the same losses up to
    the reduction order of the gradients."""
    run_dir = _run(prompts, f"{backend}-{zero_stage}", {"backend": backend, "zero_stage": zero_stage})
    records = _trained(run_dir, backend, zero_stage)
    assert (run_dir / "model" / "model.safetensors").is_file()
    for key in ("reward", "completions/mean_length", "eval_reward"):
        assert [r.get(key) for r in records] == [r.get(key) for r in ddp], key
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in ddp], rel=1e-4, abs=1e-6)


def test_lora_under_zero3_scores_the_adapter_disabled_reference_on_the_gathered_weights(prompts):
    run_dir = _run(prompts, "lora-zero3", {"backend": "deepspeed", "zero_stage": 3},
                   {"method": "lora", "optimizer": {"lr": 1e-2}}, beta=0.1)
    records = _trained(run_dir, "deepspeed", 3)
    assert records[0]["kl"] == 0.0  # the adapters start at zero: the policy is its reference
    assert any(r["kl"] > 0 for r in records[1:])
