"""`orchestrate chat` of a finished GRPO run renders a prompt the way the run rendered its prompts
(methods/grpo/prompts.py `render_prompt`; `Grpo.record_format` "prompt-completion" read by chat.py):
plain-text prompts as they are (no chat template, although the tokenizer has one), chat-message
prompts and plain text with data.chat_template through the template with its generation prompt."""

from __future__ import annotations

import pytest

from orchestrate import api
from orchestrate.chat import _encode
from orchestrate.data.tokenizer import load_tokenizer
from orchestrate.methods.grpo.prompts import render_prompt
from orchestrate.methods.grpo.runtime import _template
from tests.helpers.fake_runs import chat_run

PROMPT = "Repeat: river"
GRPO = {"max_completion_length": 8, "rewards": [{"kind": "exact_match", "column": "answer"}]}


def _run(tmp_path, prompt, data: dict | None = None):
    """A finished GRPO run on one prompt record (its tokenizer has a chat template)."""
    return chat_run(tmp_path, "prompts.jsonl", {"prompt": prompt, "answer": "river"}, {"data": data or {}, "grpo": GRPO})


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
