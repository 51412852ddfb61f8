"""Both phases of a GRPO step as planned against what they hold, on a scaled-down Llama shape (4
layers, hidden 128, 2 KV heads): the simulation's live-storage counter (orchestrate/simulate/counter.py)
over real tensors on the CPU, fp32, the weights left out (they are the plan's weights term).

- rollout: `rollout.generate` (HF generate) against memory.py `rollout_bytes`, within 5 % for a
  prefill-bound, a decode-bound and a mixed shape;
- training: the loss's forward and backward over the num_generations rows of one prompt
  (`completion_logps`, `policy_loss`) against the planner's activations and logits of those rows (the
  planner's own terms, shared by every causal-LM method: planner/activations.py, constants.py's fp32
  logits), within 5 %, with and without the chunked loss.

`orchestrate plan --simulate` runs both phases on fake tensors against the whole plan:
test_grpo_simulation.py."""

from __future__ import annotations

import pytest
import torch

from orchestrate.config.load import config_from_dict
from orchestrate.methods.grpo.losses import policy_loss
from orchestrate.methods.grpo.memory import rollout_bytes
from orchestrate.methods.grpo.rollout import completion_logps, generate
from orchestrate.methods.registry import method_terms
from orchestrate.model.formulas import shape_from_dict
from orchestrate.planner.memory import estimate_memory
from orchestrate.planner.strategy import Strategy
from orchestrate.simulate.counter import LiveStorageCounter
from tests.helpers.plans import cpu_hardware

pytestmark = pytest.mark.slow  # the counter costs a Python call per op: 10-40 s on 2 busy cores

ARCH = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512}
NEVER = 1005
"""An end-of-sequence id past the vocabulary: every completion runs to max_completion_length."""


def _setup(prompt: int, completion: int, generations: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = config_from_dict({
        "model": {"architecture": dict(ARCH)},
        "train": {"seq_len": prompt + completion, "global_batch_size": 1, "micro_batch_size": 1},
        "grpo": {"num_generations": generations, "max_completion_length": completion,
                 "rewards": [{"kind": "format", "pattern": "x"}]}})
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in ARCH.items() if k != "model_type"}))
    return config, model, [[i % 999 + 1 for i in range(prompt)]]


def _held(counter: LiveStorageCounter) -> int:
    """The counter's peak less the weights (a linear layer's weight is first seen as its transpose)."""
    weights = sum(life.nbytes for life in counter.lives if life.live_at(counter.peak_t) and life.op == "t.default")
    return counter.peak - weights


@pytest.mark.parametrize(("prompt", "completion", "generations"), [
    (96, 2, 8),    # prefill-bound: the last block's transients over the prompt
    (32, 96, 8),   # decode-bound: the whole cache at the last token
    (256, 32, 4),  # a long prompt, a short completion
])
def test_the_rollout_phase_holds_what_the_plan_says_within_5_percent(prompt, completion, generations):
    config, model, prompts = _setup(prompt, completion, generations)
    counter = LiveStorageCounter()
    with counter:
        rollout = generate(model, prompts, config.grpo, eos_ids=[NEVER], pad_id=0)
    assert rollout.completion_ids.shape == (generations, completion)
    planned = sum(rollout_bytes(shape_from_dict(ARCH), config.grpo, generations, prompt + completion, 4).values())
    assert planned / _held(counter) == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("chunks", [0, 4])
def test_the_training_phase_holds_the_planner_s_activations_and_logits_within_5_percent(chunks):
    prompt, completion, generations = 32, 96, 8
    config, model, prompts = _setup(prompt, completion, generations)
    rollout = generate(model, prompts, config.grpo, eos_ids=[NEVER], pad_id=0)
    counter = LiveStorageCounter()
    with counter:
        logps = completion_logps(model, rollout, chunks)
        advantages = torch.linspace(-1, 1, generations)
        policy_loss(config.grpo, logps, logps.detach(), advantages, rollout.completion_mask).loss.backward()
    shape, hw = shape_from_dict(ARCH), cpu_hardware(1)
    strategy = Strategy("ddp", 0, "none", "none", "fp32", False, 1, loss_chunks=chunks)
    memory = estimate_memory(shape, hw, strategy, prompt + completion, methods=method_terms(config, shape, hw))
    planned = memory.gpu["activations"] + memory.gpu["logits"]
    assert planned / _held(counter) == pytest.approx(1.0, abs=0.05)
