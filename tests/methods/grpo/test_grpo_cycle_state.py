"""What a checkpoint keeps of a GRPO num_iterations cycle (objective.py `state_dict` /
`load_state_dict`, the `StatefulObjective` hook): an objective rebuilt from the state of a step inside
a cycle, written with torch.save and read back weights-only, trains the cycle's next step on the same
rollouts without sampling (the same losses, bit for bit, and the random generator untouched); at a
cycle's end nothing is kept; a resume inside a cycle without that state (a checkpoint from before it
was kept) or with state made under other settings samples afresh and says so in one line. One
process, a 2-layer Llama, the byte tokenizer; the 2-rank launch is test_grpo_resume.py."""

from __future__ import annotations

import io

import pytest
import torch

from orchestrate.config.load import config_from_dict
from orchestrate.data.tokenizer import BYTE_EOS, ByteTokenizer
from orchestrate.methods.grpo.objective import GrpoObjective
from orchestrate.methods.grpo.prompts import PromptSamples
from orchestrate.methods.grpo.rewards import reward_functions

ARCH = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 257, "max_position_embeddings": 64,
        "bos_token_id": BYTE_EOS, "eos_token_id": BYTE_EOS}
PROMPTS = PromptSamples([{"prompt": "Repeat: river"}, {"prompt": "Repeat: stone"}], 32)
MICRO_BATCHES = [{"prompt_index": torch.tensor([0])}, {"prompt_index": torch.tensor([1])}]
"""One step of two micro-batches of one prompt each."""


def _objective(**grpo) -> GrpoObjective:
    config = config_from_dict({
        "model": {"architecture": dict(ARCH)},
        "train": {"seq_len": 32, "global_batch_size": 2, "micro_batch_size": 1},
        "grpo": {"num_generations": 2, "max_completion_length": 6, "num_iterations": 2,
                 "rewards": [{"kind": "format", "pattern": "[aeiou]"}], **grpo}})
    return GrpoObjective(config, PROMPTS, PROMPTS, ByteTokenizer(), None, reward_functions(config), [BYTE_EOS],
                         None, accumulation=len(MICRO_BATCHES))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{k: v for k, v in ARCH.items() if k != "model_type"}))


def _step(objective: GrpoObjective, model: torch.nn.Module) -> list[torch.Tensor]:
    """One step's rollout phase and micro-batch losses (no optimizer: the weights stay)."""
    objective.begin_step(model, MICRO_BATCHES)
    return [objective.loss(model, batch).detach() for batch in MICRO_BATCHES]


def _through_a_file(state: dict) -> dict:
    """What a checkpoint's objective file gives back (worker/checkpointing.py: torch.save, weights_only load)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_step_inside_a_cycle_resumes_on_the_cycle_s_rollouts_without_sampling(model):
    whole = _objective()
    torch.manual_seed(1)
    _step(whole, model)  # step 1 samples the cycle's rollouts
    whole.take_sums()
    state = _through_a_file(whole.state_dict())
    assert len(state["kept"]) == len(MICRO_BATCHES)
    want = _step(whole, model)  # step 2 trains on them again
    assert whole.state_dict() == {}, "a cycle's end keeps nothing: the next step samples"

    resumed = _objective()
    resumed.load_state_dict(state)
    resumed.start_at(1)
    generator = torch.get_rng_state()
    got = _step(resumed, model)
    assert torch.equal(torch.get_rng_state(), generator), "the resumed step sampled"
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (got, want)
    assert resumed.take_sums() == whole.take_sums()  # the step's loss metrics, and no rewards: nothing was sampled


@pytest.mark.parametrize(("state_from", "why"), [
    (None, "written before checkpoints kept them"),
    ({"num_generations": 4}, "grpo.num_generations 4 -> 2"),
])
def test_a_resume_inside_a_cycle_without_fitting_rollouts_samples_afresh_and_says_so(model, capsys, state_from, why):
    resumed = _objective()
    if state_from is not None:
        before = _objective(**state_from)
        before.begin_step(model, MICRO_BATCHES)
        resumed.load_state_dict(_through_a_file(before.state_dict()))
    resumed.start_at(1)
    capsys.readouterr()
    generator = torch.get_rng_state()
    _step(resumed, model)
    assert not torch.equal(torch.get_rng_state(), generator), "the step did not sample"
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("orchestrate:")]
    assert len(lines) == 1 and "step 2 is inside a grpo.num_iterations cycle" in lines[0] and why in lines[0], lines
