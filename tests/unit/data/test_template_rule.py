"""One rule says which records go through a chat template (records.py `uses_chat_template`), and the
data pipeline (sft_prepare.py `template_for`) follows it: chat records and records of messages always,
prompt-completion, Alpaca and text preference records only with data.chat_template set, plain text
never. `orchestrate chat` asks the same rule (tests/unit/cli/test_chat_rendering.py)."""

from __future__ import annotations

import pytest

from orchestrate.config.load import config_from_dict
from orchestrate.data.method_data import NO_METHOD_DATA
from orchestrate.data.records import uses_chat_template
from orchestrate.data.sft_prepare import SftSettings
from orchestrate.data.tokenizer import load_tokenizer
from tests.helpers.chat_tokenizers import family_tokenizer
from tests.helpers.plans import TINY_GPT2

TABLE = [
    # record format, data.chat_template set, records of messages -> rendered through the template
    ("chat", False, False, True),
    ("chat", True, False, True),
    ("prompt-completion", False, False, False),
    ("prompt-completion", True, False, True),
    ("prompt-completion", False, True, True),
    ("alpaca", False, False, False),
    ("alpaca", True, False, True),
    ("preference", False, False, False),
    ("preference", True, False, True),
    ("preference", False, True, True),
    ("unpaired-preference", False, False, False),
    ("unpaired-preference", False, True, True),
    ("text", False, False, False),
    ("text", True, False, False),
]


@pytest.mark.parametrize(("record_format", "chat_template", "messages", "templated"), TABLE)
def test_which_records_go_through_the_chat_template(record_format, chat_template, messages, templated):
    assert uses_chat_template(record_format, chat_template, messages) is templated


@pytest.mark.parametrize(("record_format", "chat_template", "messages", "templated"),
                         [row for row in TABLE if row[0] != "text"])
def test_the_data_pipeline_renders_by_the_rule(tmp_path, record_format, chat_template, messages, templated):
    family_tokenizer(tmp_path / "tok", "qwen2")
    data = {**({"chat_template": "chatml"} if chat_template else {})}
    config = config_from_dict({"model": {"architecture": TINY_GPT2}, "data": data,
                               "train": {"seq_len": 32, "global_batch_size": 8, "max_steps": 1}})
    settings = SftSettings.of(config, NO_METHOD_DATA)
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert (settings.template_for(record_format, tokenizer, messages) is not None) is templated
