"""Properties over records of every format (chat, ShareGPT, prompt-completion, Alpaca, preference pairs,
KTO, GRPO's prompt files) and over chat templates: whatever a record holds, encoding it gives its
tokens or a problem that names it (collected into one UserError by prepare), never another
exception, in bounded time; whatever a chat template says, rendering it gives text or a template
error (one UserError naming the template, chat_template.py `limit_error`), never another exception,
in bounded time. The strategies and checks are tests/helpers/input_fuzz.py's (bench/fuzz.py runs
them longer)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from tests.helpers.input_fuzz import (
    RECORD_FORMATS,
    check_template,
    grpo_prompt_surface,
    record_surface,
    template_sources,
)

FAST = settings(max_examples=25, deadline=None, derandomize=True)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("records")


@pytest.mark.parametrize("name", list(RECORD_FORMATS))
def test_any_record_gives_tokens_or_a_problem(workdir, name):
    surface = record_surface(workdir, name)
    FAST(given(surface.strategy)(surface.check))()


def test_any_grpo_prompt_file_gives_prompts_or_one_user_error(workdir):
    """A GRPO prompt file of any lines (records with any prompt, any JSON value, bytes that are no
    UTF-8): its records and each prompt's ids, or one UserError naming the data key."""
    surface = grpo_prompt_surface(workdir / "grpo")
    FAST(given(surface.strategy)(surface.check))()


@FAST
@given(template_sources)
def test_any_template_renders_or_is_a_template_error(source):
    check_template(source)
