"""GRPO end to end through the CLI on 2 gloo ranks (slow): examples/grpo's tiny Llama and byte
tokenizer, each rank sampling the completions of its own prompts. Full fine-tuning trains (non-zero
losses and gradients) and logs TRL's metrics every step; LoRA with beta > 0 and
num_iterations 2 measures a KL to the adapter-disabled base that grows from 0, and trains the kept
rollouts of a step again in the next (a step that logs no rewards of its own)."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_fault_tolerance import _launch, _metrics

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo"
# a reward that varies among a random model's completions (a vowel in them), so the advantages are not all 0
REWARDS = [{"kind": "format", "pattern": "[aeiou]"}, {"kind": "exact_match", "column": "answer", "pattern": "^([^\\n]*)"}]
METRICS = ("reward", "reward_std", "rewards/format/mean", "rewards/exact_match/mean", "completions/mean_length",
           "completions/clipped_ratio", "clip_ratio")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    train, held = runpy.run_path(str(EXAMPLE / "make_prompts.py"))["make"](64, 8, 0)
    for name, rows in (("prompts.jsonl", train), ("held_out.jsonl", held)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    def launch(name: str, train: dict, **grpo) -> Path:
        config = yaml.safe_load((EXAMPLE / "model.yaml").read_text())
        config["train"].update(max_steps=4, eval_every=2, output_dir=str(root), **train)
        config["data"].update(train_files=[str(root / "prompts.jsonl")], validation_files=[str(root / "held_out.jsonl")])
        config["grpo"].update(rewards=REWARDS, **grpo)
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        code, out = _launch(path, root / name)
        assert code == 0, out[-3000:]
        return root / name

    return launch


def test_full_fine_tuning_trains_on_its_rollouts_and_logs_trl_s_metrics(run):
    run_dir = run("full", {})
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert all(key in record for key in METRICS), record
        assert 0.0 <= record["completions/clipped_ratio"] <= 1.0 and record["completions/mean_length"] <= 8
    assert any(r["grad_norm"] > 0 and r["loss"] != 0 for r in records)  # the advantages were not all 0
    assert "eval_reward" in records[1] and "eval_rewards/format/mean" in records[3]
    assert (run_dir / "model" / "model.safetensors").is_file()


def test_lora_with_a_kl_to_the_adapter_disabled_base_and_two_updates_per_rollout(run):
    records = _metrics(run("lora", {"method": "lora", "optimizer": {"lr": 1e-2}}, beta=0.1, num_iterations=2))
    assert records[0]["kl"] == 0.0  # the adapters start at zero: the policy is its reference
    assert any(r["kl"] > 0 for r in records[1:])
    fresh, reused = records[0::2], records[1::2]
    assert all("reward" in r for r in fresh) and not any("reward" in r for r in reused)
    assert all("clip_ratio" in r for r in records)
