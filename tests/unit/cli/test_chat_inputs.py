"""`orchestrate chat` refuses with one message what it cannot answer: a conversation longer than the
model's positions (GPT-2 would raise IndexError, a RoPE model emit garbage past them), text that is
no UTF-8 (on stdin or in --prompt), and a saved chat template that the sandbox refuses or that runs
past its limits; and the reply stops where the positions end."""

from __future__ import annotations

import pytest

from orchestrate.chat import ChatModel, reply
from orchestrate.data.chat_templates import CHATML
from orchestrate.errors import UserError
from tests.helpers.chat_tokenizers import word_chat_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "hello", "there", "yes", "no"]


def _chat(tmp_path, family: str, positions: int, template: str = CHATML.source) -> ChatModel:
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    word_chat_tokenizer(tmp_path / "tok", WORDS, SPECIALS, eos="<|im_end|>", template=template)
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=positions, n_embd=16, n_layer=1, n_head=2))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=16, max_position_embeddings=positions, hidden_size=16,
                                             intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    return ChatModel(model.eval(), tok, [tok.eos_token_id], tmp_path)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_prompt_longer_than_the_positions_is_refused(tmp_path, family):
    chat = _chat(tmp_path, family, positions=16)
    with pytest.raises(UserError, match="longer than the model can read") as info:
        reply(chat, [{"role": "user", "content": "hello " * 40}])
    assert "16 positions" in str(info.value)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_reply_stops_where_the_positions_end(tmp_path, family):
    chat = _chat(tmp_path, family, positions=16)
    chat.stops = []  # no end token: only the positions stop it
    reply(chat, [{"role": "user", "content": "hello"}], max_new_tokens=100)  # no IndexError past 16


def test_a_prompt_that_is_no_utf8_is_refused(tmp_path):
    chat = _chat(tmp_path, "gpt2", positions=64)
    bad = b"caf\xe9".decode("utf-8", "surrogateescape")  # what argv holds for those bytes
    with pytest.raises(UserError, match="not valid UTF-8"):
        reply(chat, [{"role": "user", "content": bad}])


@pytest.mark.parametrize(("template", "says"), [
    ("{{ ''.__class__.__mro__ }}", "unsafe"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nests calls deeper"),
    ("{{ 'x' * 4000000000 }}", "multiplies"),
])
def test_a_saved_template_the_sandbox_refuses_is_one_error(tmp_path, template, says):
    chat = _chat(tmp_path, "gpt2", positions=64, template=template)
    with pytest.raises(UserError, match="chat template cannot be rendered") as info:
        reply(chat, [{"role": "user", "content": "hello"}])
    assert says in str(info.value) and info.value.problems[0].where == "RUN_DIR"


def test_stdin_that_is_no_utf8_is_one_error_with_exit_2(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from orchestrate import api
    from orchestrate.cli import cli

    chat = _chat(tmp_path, "gpt2", positions=64)
    monkeypatch.setattr(api, "chat_model", lambda run_dir, adapter, template, system: chat)
    result = CliRunner().invoke(cli, ["chat", str(tmp_path)], input=b"caf\xe9\n")
    assert result.exit_code == 2, result.output
    assert "not valid UTF-8" in result.output and "Traceback" not in result.output
