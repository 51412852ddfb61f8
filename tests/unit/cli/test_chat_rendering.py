"""`orchestrate chat` renders a prompt the way training rendered the run's records (data/records.py
`uses_chat_template`, read from RUN_DIR/plan.json and the first training record): a prompt-completion
or Alpaca run without data.chat_template gets exactly the prompt ids training built (Alpaca's prompt
around it, no chat template although the tokenizer has one) and stops at EOS only; with
data.chat_template set it gets the template; `--template` / `--raw` force either. The run's
data.system_prompt goes where training put it, unless `--system` gives another or '' none."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from orchestrate import api
from orchestrate.chat import _encode
from orchestrate.cli import cli
from orchestrate.data.method_data import NO_METHOD_DATA
from orchestrate.data.sft_prepare import ANSWER, SftSettings, tokenize_records
from orchestrate.data.tokenizer import load_tokenizer
from orchestrate.errors import UserError
from tests.helpers.fake_runs import chat_run

PROMPT = "Uppercase: river"
RECORDS = {"prompt-completion": {"prompt": PROMPT, "completion": " RIVER"},
           "alpaca": {"instruction": PROMPT, "output": "RIVER"}}


def _run(tmp_path, record_format: str, data: dict | None = None):
    """A finished run (its tokenizer has a chat template) trained on one record of `record_format`
    (data.record_format: auto, detected from the file)."""
    return chat_run(tmp_path, "train.jsonl", RECORDS[record_format], {"data": data or {}})


def _training_prompt_ids(plan, record_format: str, tok_dir) -> list[int]:
    """The ids the data pipeline wrote before the record's answer."""
    settings = SftSettings.of(plan.config, NO_METHOD_DATA)
    tokenizer = load_tokenizer(tok_dir)
    record = RECORDS[record_format]
    out = tokenize_records({k: [v] for k, v in record.items()}, [0], tokenizer=tokenizer, settings=settings,
                           record_format=record_format, template=settings.template_for(record_format, tokenizer),
                           dtype="int64")
    ids, mask = out["input_ids"][0], out["mask"][0]
    return ids[: int(np.argmax(mask & ANSWER > 0))].tolist()


@pytest.mark.parametrize("record_format", ["prompt-completion", "alpaca"])
def test_chat_prompts_a_raw_run_with_the_ids_training_built(tmp_path, record_format):
    run, plan = _run(tmp_path, record_format)
    chat = api.chat_model(run)
    assert not chat.template and chat.stops == [chat.tokenizer.eos_token_id]
    assert _encode(chat, [{"role": "user", "content": PROMPT}]) == _training_prompt_ids(plan, record_format, tmp_path / "tok")


@pytest.mark.parametrize("record_format", ["prompt-completion", "alpaca"])
def test_chat_gives_the_runs_system_prompt_where_training_gave_it(tmp_path, record_format):
    """data.system_prompt went into every training record without one: chat puts it in the same place
    (before a raw prompt, in place of Alpaca's preamble), and `--system` replaces it."""
    run, plan = _run(tmp_path, record_format, {"system_prompt": "Answer in capitals."})
    chat = api.chat_model(run)
    assert chat.system == "Answer in capitals."
    ids = _encode(chat, [{"role": "user", "content": PROMPT}])
    assert ids == _training_prompt_ids(plan, record_format, tmp_path / "tok")
    assert "Answer in capitals." in chat.tokenizer.decode(ids)
    own = _encode(chat, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}])
    decoded = chat.tokenizer.decode(own)
    assert "Be brief." in decoded and "capitals" not in decoded


def test_a_templated_run_chats_with_its_system_prompt_as_the_first_turn(tmp_path):
    run, _ = _run(tmp_path, "prompt-completion", {"chat_template": "chatml", "system_prompt": "Answer in capitals."})
    chat = api.chat_model(run)
    user = [{"role": "user", "content": PROMPT}]
    expected = chat.tokenizer.apply_chat_template([{"role": "system", "content": "Answer in capitals."}, *user],
                                                  add_generation_prompt=True)["input_ids"]
    assert _encode(chat, user) == expected


@pytest.mark.parametrize("template", [None, "chatml"])
def test_system_replaces_the_runs_system_prompt_and_an_empty_one_drops_it(tmp_path, template):
    """Raw (the prompt's preamble) and templated (the first turn) alike: `system` takes the run's place,
    '' leaves the conversation without one, as a run without data.system_prompt prompts."""
    run, plan = _run(tmp_path, "prompt-completion", {"chat_template": template, "system_prompt": "Answer in capitals."})
    user = [{"role": "user", "content": PROMPT}]
    other = api.chat_model(run, system="Be brief.")
    assert _encode(other, user) == _encode(other, [{"role": "system", "content": "Be brief."}, *user])
    assert "capitals" not in other.tokenizer.decode(_encode(other, user))
    dropped = api.chat_model(run, system="")
    assert dropped.system is None
    if template is None:  # the very ids a run without a system prompt trained its prompt on
        plain = plan.model_copy(update={"config": plan.config.model_copy(update={
            "data": plan.config.data.model_copy(update={"system_prompt": None})})})
        assert _encode(dropped, user) == _training_prompt_ids(plain, "prompt-completion", tmp_path / "tok")
    else:
        assert _encode(dropped, user) == dropped.tokenizer.apply_chat_template(user, add_generation_prompt=True)["input_ids"]


@pytest.mark.parametrize(("flags", "system"), [([], "Answer in capitals."), (["--system", "Be brief."], "Be brief."),
                                               (["--system", ""], None)])
def test_the_system_option_reaches_the_chat(tmp_path, monkeypatch, flags, system):
    run, _ = _run(tmp_path, "prompt-completion", {"system_prompt": "Answer in capitals."})
    asked = []
    monkeypatch.setattr(api, "chat_reply", lambda chat, messages, *rest: asked.append((chat.system, list(messages))) or "OK")
    result = CliRunner().invoke(cli, ["chat", str(run), "--prompt", PROMPT, *flags])
    assert result.exit_code == 0, result.output
    assert asked == [(system, [{"role": "user", "content": PROMPT}])]


def test_template_forces_the_chat_template(tmp_path):
    run, _ = _run(tmp_path, "prompt-completion")
    chat = api.chat_model(run, template=True)
    messages = [{"role": "user", "content": PROMPT}]
    assert chat.template
    assert _encode(chat, messages) == chat.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert chat.tokenizer.convert_tokens_to_ids("<|im_end|>") in chat.stops


def test_a_run_with_data_chat_template_chats_with_the_template(tmp_path):
    run, _ = _run(tmp_path, "prompt-completion", {"chat_template": "chatml"})
    assert api.chat_model(run).template
    assert not api.chat_model(run, template=False).template


def test_a_run_whose_data_is_gone_asks_for_the_flag(tmp_path):
    run, _ = _run(tmp_path, "prompt-completion")
    (tmp_path / "train.jsonl").unlink()
    with pytest.raises(UserError, match="cannot tell how the run rendered its records") as info:
        api.chat_model(run)
    assert "--template" in str(info.value) and "--raw" in str(info.value)
    chat = api.chat_model(run, template=False)
    assert _encode(chat, [{"role": "user", "content": PROMPT}]) == chat.tokenizer(PROMPT)["input_ids"]


@pytest.mark.parametrize(("flags", "template"), [([], None), (["--template"], True), (["--raw"], False)])
def test_the_flag_reaches_the_api(tmp_path, monkeypatch, flags, template):
    seen = []

    def chat_model(run_dir, adapter, template, system):
        seen.append(template)
        raise UserError("stop here", [])

    monkeypatch.setattr(api, "chat_model", chat_model)
    CliRunner().invoke(cli, ["chat", str(tmp_path), "--prompt", "hi", *flags])
    assert seen == [template]
