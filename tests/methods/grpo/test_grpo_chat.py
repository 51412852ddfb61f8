"""`orchestrate chat` of a finished GRPO run renders a prompt the way the run rendered its prompts
(methods/grpo/prompts.py `render_prompt`; `Grpo.record_format` "prompt-completion" read by chat.py):
plain-text prompts as they are (no chat template, although the tokenizer has one), chat-message
prompts and plain text with data.chat_template through the template with its generation prompt."""

from __future__ import annotations

import json

import pytest

from orchestrate import api
from orchestrate.chat import _encode
from orchestrate.data.tokenizer import load_tokenizer
from orchestrate.methods.grpo.prompts import render_prompt
from orchestrate.methods.grpo.runtime import _template
from orchestrate.planner.strategy import Strategy
from tests.helpers.chat_tokenizers import family_tokenizer
from tests.helpers.plans import TINY_GPT2, make_plan

PROMPT = "Repeat: river"
GRPO = {"max_completion_length": 8, "rewards": [{"kind": "exact_match", "column": "answer"}]}


def _run(tmp_path, prompt, data: dict | None = None):
    """A finished GRPO run (plan.json, RUN_DIR/model with a tokenizer that has a chat template) on one
    prompt record."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    family_tokenizer(tmp_path / "tok", "qwen2")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": prompt, "answer": "river"}) + "\n")
    plan = make_plan(Strategy("ddp", 0, "none", "none", "fp32", False, 1), ranks=1, source_dir=tmp_path, config={
        "model": {"architecture": {**TINY_GPT2, "vocab_size": 400}},
        "data": {"tokenizer": "tok", "train_files": ["prompts.jsonl"], **(data or {})}, "grpo": GRPO})
    run = tmp_path / "run"
    run.mkdir()
    plan.write(run / "plan.json")
    model = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in TINY_GPT2.items() if k not in ("model_type", "vocab_size")},
                                       vocab_size=400))
    model.save_pretrained(run / "model")
    AutoTokenizer.from_pretrained(tmp_path / "tok").save_pretrained(run / "model")
    return run, plan


def _sampled_from(plan, prompt, tok_dir) -> list[int]:
    """The prompt ids the run's rollouts sampled after (the GRPO runtime's template, render_prompt)."""
    tokenizer = load_tokenizer(tok_dir)
    return render_prompt(prompt, plan.config, tokenizer, _template(plan, tokenizer))


@pytest.mark.parametrize(("prompt", "data", "templated"), [
    (PROMPT, None, False),
    (PROMPT, {"chat_template": "chatml"}, True),
    ([{"role": "user", "content": PROMPT}], None, True),
])
def test_chat_prompts_a_grpo_run_with_the_ids_its_rollouts_sampled_after(tmp_path, prompt, data, templated):
    run, plan = _run(tmp_path, prompt, data)
    chat = api.chat_model(run)
    assert chat.template is templated
    assert _encode(chat, [{"role": "user", "content": PROMPT}]) == _sampled_from(plan, prompt, tmp_path / "tok")
