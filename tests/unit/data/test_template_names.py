"""The template names users type: every alias (llama3, llama-3.1, qwen2.5, phi3, gemma2, ...) renders
with its family's named template, in any case; an unknown name is one error listing the known ones.
The zephyr and alpaca templates render their published turn formats (written out here by hand from
zephyr-7b-beta's chat_template and Axolotl's alpaca.jinja), their generation markers mark what turn-by-
turn rendering finds, and `orchestrate tokenizer train` takes an alias too."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from orchestrate.config.load import config_from_dict
from orchestrate.data.chat_template import ChatTemplate, render, yaml_template
from orchestrate.data.chat_templates import ALIASES, ALPACA, NAMED_TEMPLATES, ZEPHYR
from orchestrate.data.sft_tokens import encode_chat
from orchestrate.errors import UserError
from tests.helpers.chat_tokenizers import word_chat_tokenizer

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "paris"}, {"role": "user", "content": "say hi"},
        {"role": "assistant", "content": "bonjour"}]
MISTRAL_TOKENS = SimpleNamespace(special_tokens_map={"bos_token": "<s>", "eos_token": "</s>"})


def _config(tmp_path, template: str):
    return config_from_dict({"model": {"architecture": {"model_type": "gpt2"}},
                             "train": {"seq_len": 8, "global_batch_size": 2},
                             "data": {"chat_template": template}}, tmp_path)


@pytest.mark.parametrize(("alias", "named"), [
    ("llama3", "llama-3"), ("llama-3.1", "llama-3"), ("Llama-3.2", "llama-3"), ("qwen2.5", "chatml"), ("qwen2", "chatml"),
    ("QWEN", "chatml"), ("mixtral", "mistral"), ("phi3", "phi-3"), ("phi_35", "phi-3"), ("gemma2", "gemma"),
    ("gemma-3", "gemma"), ("zephyr", "zephyr"), ("alpaca", "alpaca"), (" ChatML ", "chatml"),
])
def test_an_alias_renders_with_its_familys_template(tmp_path, alias, named):
    template = yaml_template(_config(tmp_path, alias))
    assert template.source == NAMED_TEMPLATES[named].source
    assert template.origin == (alias if alias == named else f"{alias} ({named})")


def test_every_alias_names_a_template():
    assert set(ALIASES.values()) <= set(NAMED_TEMPLATES) and not set(ALIASES) & set(NAMED_TEMPLATES)


def test_an_unknown_name_is_one_error_listing_the_known_ones(tmp_path):
    with pytest.raises(UserError) as refused:
        yaml_template(_config(tmp_path, "llama-2"))
    (problem,) = refused.value.problems
    assert problem.where == "data.chat_template" and "'llama-2' is no template name" in problem.message
    for name in (*NAMED_TEMPLATES, "qwen2.5", "llama-3.1"):
        assert name in problem.fix, name


def test_zephyr_renders_its_published_turns():
    text, _ = render(ChatTemplate(ZEPHYR.source, "zephyr"), MISTRAL_TOKENS, CHAT, generation_prompt=False)
    assert text == ("<|system|>\nbe brief</s>\n<|user|>\nhello there</s>\n<|assistant|>\nparis</s>\n"
                    "<|user|>\nsay hi</s>\n<|assistant|>\nbonjour</s>\n")
    prompt, _ = render(ChatTemplate(ZEPHYR.source, "zephyr"), MISTRAL_TOKENS, CHAT[:2], generation_prompt=True)
    assert prompt == "<|system|>\nbe brief</s>\n<|user|>\nhello there</s>\n<|assistant|>\n"


def test_alpaca_renders_instruction_and_response_sections():
    text, spans = render(ChatTemplate(ALPACA.source, "alpaca"), MISTRAL_TOKENS, CHAT, generation_prompt=False)
    assert text == ("<s>be brief\n\n### Instruction:\nhello there\n\n### Response:\nparis</s>\n\n"
                    "### Instruction:\nsay hi\n\n### Response:\nbonjour</s>")
    assert [text[a:b] for a, b in spans] == ["paris</s>", "bonjour</s>"]  # each answer with its EOS, no header
    prompt, _ = render(ChatTemplate(ALPACA.source, "alpaca"), MISTRAL_TOKENS, CHAT[1:2], generation_prompt=True)
    assert prompt == "<s>### Instruction:\nhello there\n\n### Response:\n"


@pytest.mark.parametrize("named", [ZEPHYR, ALPACA], ids=["zephyr", "alpaca"])
@pytest.mark.parametrize("last_turn_only", [False, True])
def test_the_markers_mark_what_turn_by_turn_rendering_finds(tmp_path, named, last_turn_only):
    from transformers import AutoTokenizer

    words = ["be", "brief", "hello", "there", "paris", "say", "hi", "bonjour", "###", "Instruction", "Response", ":"]
    specials = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
    tok = AutoTokenizer.from_pretrained(word_chat_tokenizer(tmp_path / "tok", words, specials, eos="</s>", bos="<s>"))
    marked = ChatTemplate(named.source, named.name)
    unmarked = ChatTemplate(re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", named.source), "unmarked")
    ours = encode_chat(tok, marked, CHAT, ["assistant"], False, last_turn_only=last_turn_only)
    assert ours == encode_chat(tok, unmarked, CHAT, ["assistant"], False, last_turn_only=last_turn_only)
    trained = [t for t, m in zip(tok.convert_ids_to_tokens(ours.ids), ours.mask, strict=True) if m]
    assert trained == (["bonjour", "</s>"] if last_turn_only else ["paris", "</s>", "bonjour", "</s>"])


def test_tokenizer_train_takes_an_alias(tmp_path):
    from transformers import AutoTokenizer

    from orchestrate.data.tokenizer_train import train_tokenizer

    rows = [{"messages": [{"role": "user", "content": f"upper case word {w}"}, {"role": "assistant", "content": w.upper()}]}
            for w in ["apple", "river", "garden", "window"] * 20]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = config_from_dict({"model": {"architecture": {"model_type": "qwen2"}}, "train": {"seq_len": 8, "global_batch_size": 2},
                               "data": {"train_files": ["chats.jsonl"], "chat_template": "qwen2.5"}}, tmp_path)
    out, _ = train_tokenizer(config, 400, tmp_path / "tok", progress=False)
    assert AutoTokenizer.from_pretrained(out).chat_template == NAMED_TEMPLATES["chatml"].source
