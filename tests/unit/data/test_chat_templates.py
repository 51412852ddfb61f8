"""Chat templates give each family's BOS and end-of-turn tokens exactly once (no double EOS, no lost BOS),
the trained tokens equal transformers' `return_assistant_tokens_mask` for templates with generation
markers, and the same tokens are found by incremental rendering where a template has none (which
method each template gets is said here and in the data summary); templates whose turns cannot be
found are refused. Tokenizers of the five families are built locally (tests/helpers/chat_tokenizers.py),
and `orchestrate tokenizer train` makes one for a named template."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from orchestrate.config.load import config_from_dict
from orchestrate.data.chat_template import ChatTemplate, chat_template_for
from orchestrate.data.chat_templates import NAMED_TEMPLATES
from orchestrate.data.sft_tokens import (
    INCREMENTAL,
    MARKERS,
    TemplateNotIncremental,
    encode_chat,
    encode_completion,
    mask_method,
)
from tests.helpers.chat_tokenizers import FAMILIES, family_tokenizer

CHAT = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "paris is the capital"}, {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "sees the dog"}]
END_OF_TURN = {"llama-3": "<|eot_id|>", "qwen2": "<|im_end|>", "mistral": "</s>", "phi-3": "<|end|>",
               "gemma": "<end_of_turn>"}


def _unmarked(template: ChatTemplate) -> ChatTemplate:
    return ChatTemplate(re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template.source), "unmarked")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("families")
    return {f: AutoTokenizer.from_pretrained(family_tokenizer(root / f, f)) for f in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bos_once_where_the_family_has_one_and_each_answer_ends_with_one_end_of_turn(tokenizers, family):
    tok, (_, bos, _, named) = tokenizers[family], FAMILIES[family]
    enc = encode_chat(tok, ChatTemplate(NAMED_TEMPLATES[named].source, named), CHAT, ["assistant"], False)
    tokens = tok.convert_ids_to_tokens(enc.ids)
    assert tokens.count(bos) == (1 if bos else 0) and (tokens[0] == bos if bos else True)
    trained = [t for t, m in zip(tokens, enc.mask, strict=True) if m]
    eot = END_OF_TURN[family]
    assert trained.count(eot) == 2 and trained[-1] == eot  # each answer's own end, trained with it
    turns = {"mistral": 2, "gemma": 4}.get(family, 5)  # Mistral ends answers only; Gemma folds the system turn in
    assert tokens.count(eot) == turns and tokens[-1 if family in ("mistral", "llama-3") else -2] == eot  # no EOS after
    assert not (tok.eos_token != eot and tok.eos_token in tokens)
    assert tok.decode([i for i, m in zip(enc.ids, enc.mask, strict=True) if m], skip_special_tokens=True) \
        .replace(" ", "") == "parisisthecapitalseesthedog"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prompt_completion_keeps_the_tokenizers_bos_and_ends_with_one_eos(tokenizers, family):
    tok, (_, bos, eos, _) = tokenizers[family], FAMILIES[family]
    tokens = tok.convert_ids_to_tokens(encode_completion(tok, "hello there", " paris", tok.eos_token_id).ids)
    assert tokens[0] == bos if bos else tokens[0] != bos
    assert tokens.count(eos) == 1 and tokens[-1] == eos


@pytest.mark.parametrize("family", list(FAMILIES))
def test_masks_equal_return_assistant_tokens_mask_and_incremental_rendering_finds_the_same(tokenizers, family):
    tok, named = tokenizers[family], FAMILIES[family][3]
    marked = ChatTemplate(NAMED_TEMPLATES[named].source, named)
    expected = tok.apply_chat_template(CHAT, chat_template=marked.source, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
    assert sum(expected["assistant_masks"]) > 0
    ours = encode_chat(tok, marked, CHAT, ["assistant"], False)
    assert (ours.ids, ours.mask) == (list(expected["input_ids"]), list(expected["assistant_masks"]))
    incremental = encode_chat(tok, _unmarked(marked), CHAT, ["assistant"], False)
    assert (incremental.ids, incremental.mask) == (ours.ids, ours.mask)


def test_which_mask_method_each_template_gets():
    for template in NAMED_TEMPLATES.values():  # every named template carries generation markers
        assert mask_method(ChatTemplate(template.source, template.name), ["assistant"], False) == MARKERS
    assert mask_method(_unmarked(ChatTemplate(NAMED_TEMPLATES["chatml"].source, "chatml")), ["assistant"], False) \
        == INCREMENTAL
    # markers mark the assistant turns only: other trained roles are found turn by turn
    assert mask_method(ChatTemplate(NAMED_TEMPLATES["chatml"].source, "chatml"), ["user", "assistant"], False) \
        == INCREMENTAL


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizers):
    # As reasoning templates do: an answer renders differently once it is no longer the last message.
    rewrites = ChatTemplate("{% for m in messages %}{{ m.role }}:{% if loop.last %}{{ m.content }}{% else %}"
                            "...{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}", "inline")
    with pytest.raises(TemplateNotIncremental, match="renders differently"):
        encode_chat(tokenizers["qwen2"], rewrites, CHAT, ["assistant"], False)


def test_the_yaml_template_wins_over_the_tokenizers_and_a_file_works(tmp_path, tokenizers):
    (tmp_path / "mine.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")

    def config(value):
        return config_from_dict({"model": {"architecture": {"model_type": "gpt2"}}, "train": {"seq_len": 8, "global_batch_size": 2},
                                 "data": {"chat_template": value}}, tmp_path)

    assert chat_template_for(config(None), tokenizers["qwen2"]).origin == "the tokenizer's own"
    assert chat_template_for(config("gemma"), tokenizers["qwen2"]).source == NAMED_TEMPLATES["gemma"].source
    assert chat_template_for(config("mine.jinja"), None).source.startswith("{% for m")
    assert chat_template_for(config("{{ messages[0].content }}"), None).origin == "inline"


def test_tokenizer_train_makes_a_chat_tokenizer_for_a_named_template(tmp_path):
    from orchestrate.data.tokenizer_train import train_tokenizer

    rows = [{"messages": [{"role": "user", "content": f"upper case word {w}"}, {"role": "assistant", "content": w.upper()}]}
            for w in ["apple", "river", "garden", "window"] * 20]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = config_from_dict({"model": {"architecture": {"model_type": "llama"}}, "train": {"seq_len": 8, "global_batch_size": 2},
                               "data": {"train_files": ["chats.jsonl"], "chat_template": "llama-3"}}, tmp_path)
    out, _ = train_tokenizer(config, 400, tmp_path / "tok", progress=False)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == NAMED_TEMPLATES["llama-3"].source
    assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    assert tok.convert_ids_to_tokens(tok("apple")["input_ids"])[0] == "<|begin_of_text|>"  # as Llama-3's tokenizer
    ids = tok.apply_chat_template(rows[0]["messages"], tokenize=True, return_dict=True)["input_ids"]
    assert tok.convert_ids_to_tokens(ids).count("<|start_header_id|>") == 2  # atomic special tokens
