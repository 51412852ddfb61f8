"""Chat fine-tuning end to end on 2 gloo ranks through the real launcher (examples/chat-sft: a tiny base
pre-trained on generated text, its ChatML tokenizer, 600 generated chats): QLoRA and full fine-tuning
with the loss on the answers learn to answer held-out prompts, clearly better than the same runs with
the loss on every token; the metrics count the tokens that carry loss and hold the generated answers;
`orchestrate chat RUN_DIR --prompt` answers from RUN_DIR/model and from base + RUN_DIR/adapter as the
run itself answered; DPO after the QLoRA run (examples/chat-sft/dpo.yaml) learns its preference; RUN_DIR/model and RUN_DIR/adapter carry the tokenizer with its chat template.

The workspace and each run are built once per session (about 2 minutes on 2 cores); the own-loop
comparison and the three methods' numbers are bench/sft_learning.py's (seed noise needs repeats)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from orchestrate.cli import cli
from orchestrate.data.chat_templates import CHATML
from tests.helpers.chat_sft import build_workspace, dpo_after, final_record, fine_tune

pytestmark = pytest.mark.slow
GENERATE = ["train.eval_generate=20"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("chat-sft"))


@pytest.fixture(scope="module")
def qlora(workspace) -> Path:
    return fine_tune(workspace, "qlora", GENERATE)  # model.yaml as it is: QLoRA, answers only


@pytest.fixture(scope="module")
def full(workspace) -> Path:
    return fine_tune(workspace, "full", ["train.method=full", *GENERATE])


def _chat(run_dir: Path, prompt: str, *flags: str) -> str:
    result = CliRunner().invoke(cli, ["chat", str(run_dir), "--prompt", prompt, *flags])
    assert result.exit_code == 0, result.output
    return result.stdout.strip()  # the answer; transformers' loading bar goes to stderr


def _held_out_prompt(record: dict) -> tuple[str, str]:
    """The first held-out prompt's user text and what the run generated for it."""
    first = record["eval_generations"][0]
    user = first["prompt"].split("user\n", 1)[1].rsplit("\nassistant", 1)[0]
    return user, first["generated"]


def test_qlora_on_the_answers_learns_to_answer_held_out_prompts(qlora):
    record = final_record(qlora)
    assert record["eval_exact_match"] >= 0.5, record["eval_generations"]  # measured 0.9 (18 of 20)
    assert 0 < record["loss_tokens"] < record["tokens"] / 4  # answers are a small share of the positions
    assert record["loss_tokens_per_s"] > 0 and record["eval_loss_tokens"] > 0


def test_chat_answers_from_the_base_and_the_adapter_as_the_run_did(qlora):
    user, generated = _held_out_prompt(final_record(qlora))
    assert _chat(qlora, user, "--adapter") == generated


def test_chat_answers_from_the_trained_model_as_the_run_did(full):
    user, generated = _held_out_prompt(final_record(full))
    assert _chat(full, user) == generated
    assert _chat(full, user, "--model") == generated


def test_the_tokenizer_and_its_chat_template_are_saved_with_the_model_and_the_adapter(qlora):
    for directory in (qlora / "model", qlora / "adapter"):
        tok = AutoTokenizer.from_pretrained(directory)
        assert tok.chat_template == CHATML.source and tok.eos_token == "<|im_end|>"


def test_the_loss_on_the_answers_beats_the_loss_on_every_token(workspace, full):
    every = final_record(fine_tune(workspace, "full-every-token", ["train.method=full", "data.train_on_inputs=true",
                                                                    *GENERATE]))
    answers = final_record(full)
    # measured (seed 0, 20 prompts): 0.8 against 0.3; bench/sft_learning.py: 47.0 vs 12.3 of 60 over 3 seeds
    assert answers["eval_exact_match"] >= every["eval_exact_match"] + 0.3
    assert answers["eval_loss"] < every["eval_loss"]  # both the answer-token loss on the same held-out samples
    assert every["loss_tokens"] > 3 * answers["loss_tokens"]  # every token carried loss there


def test_dpo_after_the_sft_run_prefers_the_marked_answers_on_held_out_prompts(workspace, qlora):
    # DPO with QLoRA on the SFT run's RUN_DIR/model, its reference the adapter-disabled base (the SFT model)
    record = final_record(dpo_after(workspace, qlora))
    reference_margin = record["eval_logps_margin"] - record["eval_rewards/margins"] / 0.1  # beta of dpo.yaml
    # measured (seed 0): log p("WORD!") - log p("WORD") -15.8 for the SFT model, +16.0 after 40 steps
    assert reference_margin < 0 < record["eval_logps_margin"]
    assert record["eval_rewards/accuracies"] > 0.9


def test_chat_of_a_directory_that_is_no_run_says_so(tmp_path):
    result = CliRunner().invoke(cli, ["chat", str(tmp_path), "--prompt", "hi"])
    assert result.exit_code == 2 and "is not a run directory" in result.output and "Traceback" not in result.output
