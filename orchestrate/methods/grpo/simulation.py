"""GRPO's rollout phase as `plan --simulate` runs it (methods/spec.py `SimulatedPhase`), on fake tensors:
the weights gathered as the run gathers them (gather.py), HF `generate` sampling max_completion_length
tokens for every row (the simulation's decoding never ends early: simulate/patches.py, the worst case the
plan prices), then the no_grad scoring forwards the objective takes after sampling (π_old with
num_iterations > 1, the adapter-disabled reference with beta > 0 under LoRA / QLoRA), one at a time.
What the objective keeps through the step (objective.py `Scored`) is returned for the harness to keep.
The training micro-batch after it is the harness's causal-LM step over the same rows: its loss holds what
GRPO's does (tests/methods/grpo/test_grpo_phases.py checks both against the plan on real tensors)."""

from __future__ import annotations

from typing import Any

import torch

from orchestrate.methods.grpo.config import GrpoSection
from orchestrate.methods.grpo.gather import gathered
from orchestrate.methods.grpo.rollout import completion_logps, generate
from orchestrate.methods.grpo.runtime import adapter_reference


def rollout(model: torch.nn.Module, settings: dict[str, Any]) -> list[torch.Tensor]:
    """One micro-batch's rollout phase: `settings` from method.py `Grpo.simulated_phase`."""
    section = GrpoSection.model_validate(settings["grpo"])
    prompts = [[1] * settings["prompt_positions"] for _ in range(settings["prompts"])]
    chunks = settings["loss_chunks"]
    with gathered(model, settings["reshard_after_forward"]) as inner:
        sampled = generate(inner, prompts, section, eos_ids=[settings["eos_id"]], pad_id=0)
        kept = [sampled.input_ids, sampled.attention_mask, sampled.completion_mask]
        with torch.no_grad():
            if section.num_iterations > 1:
                kept.append(completion_logps(inner, sampled, chunks))
            if settings["adapter_reference"]:
                kept.append(adapter_reference(chunks)(inner, sampled))
    return kept
