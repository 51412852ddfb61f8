"""Properties over records of every format (chat, ShareGPT, prompt-completion, Alpaca, preference pairs,
KTO) and over chat templates: whatever a record holds, encoding it gives its tokens or a problem
that names it (collected into one UserError by prepare), never another exception, in bounded time;
whatever a chat template says, rendering it gives text or a template error (one UserError naming
the template, chat_template.py `limit_error`), never another exception, in bounded time."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrate.config.load import config_from_dict
from orchestrate.data import chat_template
from orchestrate.data.chat_template import ChatTemplate, render
from orchestrate.data.chat_templates import CHATML
from orchestrate.data.sft_prepare import SftSettings, tokenize_records
from orchestrate.errors import UserError
from tests.helpers.chat_tokenizers import word_chat_tokenizer
from tests.helpers.plans import TINY_GPT2

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "hello", "there", "yes", "no"]
FAST = settings(max_examples=25, deadline=None, derandomize=True)
SECONDS_PER_EXAMPLE = 5.0

texts = st.lists(st.sampled_from(["hello", " ", "there", "yes", "\n", "\t", "{{", "%}", "<|im_end|>", "\x00", "é",
                                  "🙂", "\ud800"]), max_size=12).map("".join)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), texts)
roles = st.sampled_from(["user", "assistant", "system", "tool", "human", "gpt", "bogus", None, 3])
message = st.fixed_dictionaries({}, optional={
    "role": roles, "content": st.one_of(texts, scalars, st.lists(texts, max_size=2)), "from": roles, "value": texts,
    "tool_calls": st.one_of(texts, st.lists(st.dictionaries(texts, scalars, max_size=2), max_size=2), scalars),
    "name": scalars, "tool_call_id": scalars})
anything = st.one_of(scalars, st.lists(message, max_size=6), st.lists(scalars, max_size=3),
                     st.dictionaries(texts, scalars, max_size=3))
FORMATS = {
    "chat": ["messages"], "chat-sharegpt": ["conversations"], "prompt-completion": ["prompt", "completion"],
    "alpaca": ["instruction", "input", "output"], "preference": ["prompt", "chosen", "rejected"],
    "unpaired-preference": ["prompt", "completion", "label"],
}


@functools.cache
def _setup(directory: str, record_format: str):
    from orchestrate.data.pipeline import tokenizer_for
    from orchestrate.methods.registry import method_data

    tmp = Path(directory)
    if not (tmp / "tok").is_dir():
        word_chat_tokenizer(tmp / "tok", WORDS, SPECIALS, eos="<|im_end|>", template=CHATML.source)
    preference = {"preference": {"loss": "kto"} if record_format == "unpaired-preference" else {"beta": 0.1}}
    config = config_from_dict({
        "model": {"architecture": {**TINY_GPT2, "vocab_size": 64, "n_positions": 128}},
        "train": {"seq_len": 32, "global_batch_size": 2},
        "data": {"tokenizer": "tok", "train_files": ["x.jsonl"], "roles_to_train": ["user", "assistant"]},
        **(preference if "preference" in record_format else {})}, tmp)
    tokenizer, _ = tokenizer_for(config)
    sft = SftSettings.of(config, method_data(config))
    return tokenizer, sft, sft.template_for("chat", tokenizer)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("records"))


@pytest.mark.parametrize("name", list(FORMATS))
def test_any_record_gives_tokens_or_a_problem(workdir, name):
    record_format = "chat" if name.startswith("chat") else name
    tokenizer, sft, template = _setup(workdir, record_format)
    columns = FORMATS[name]

    @FAST
    @given(st.fixed_dictionaries({c: anything for c in columns}))
    def check(record):
        start = time.perf_counter()
        try:
            out = tokenize_records({k: [v] for k, v in record.items()}, [0], tokenizer=tokenizer, settings=sft,
                                   record_format=record_format, template=template, dtype="int32")
        except UserError:
            return
        assert time.perf_counter() - start < SECONDS_PER_EXAMPLE
        assert len(out["input_ids"]) == 1 and isinstance(out["problem"][0], str)

    check()


fragments = st.sampled_from([
    "{% for m in messages %}", "{% endfor %}", "{{ m.content }}", "{{ m.role }}", "{% if add_generation_prompt %}",
    "{% endif %}", "{{ 'x' * 10 }}", "{{ 'x' * 9999999999 }}", "{% for i in range(100000) %}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "{% include 'a' %}", "{{ messages[0] }}", "{{ 1 / 0 }}",
    "{{ 1 + 'a' }}", "{{ ''.__class__ }}", "{{ raise_exception('no') }}", "{% set ns = namespace(a=1) %}",
    "{{ messages | tojson }}", "{% generation %}", "{% endgeneration %}", "{{", "}}", "{%", "%}", "x", "\n",
    "{{ bos_token }}", "{{ 'a'.ljust(99999999999) }}", "{{ range(3) | list }}", "{{ messages * 99999999 }}",
])


@FAST
@given(st.lists(fragments, max_size=8).map("".join))
def test_any_template_renders_or_is_a_template_error(source):
    class Tok:
        special_tokens_map = {"bos_token": "<s>", "eos_token": "</s>"}

    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes"}]
    previous, chat_template.RENDER_SECONDS = chat_template.RENDER_SECONDS, 0.5
    start = time.perf_counter()
    try:
        render(ChatTemplate(source, "fuzz.jinja"), Tok(), messages, True)
    except jinja2.TemplateError as exc:
        error = chat_template.limit_error(ChatTemplate(source, "fuzz.jinja"), exc)
        assert "fuzz.jinja" in error.problems[0].message
    finally:
        chat_template.RENDER_SECONDS = previous
    assert time.perf_counter() - start < 3
