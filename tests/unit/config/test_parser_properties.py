"""Properties of the YAML and `--set` parser over raw text (YAML syntax, control characters, lone
surrogates from undecodable argv bytes, aliases, deep nesting): the result is a value or one
UserError, never another exception, in bounded time; and through the CLI, exit 0 or 2 without a
traceback."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.input_fuzz import check_overrides, check_yaml_text, demo_config, invoke_cli, raw_yaml

FAST = settings(max_examples=60, deadline=None, derandomize=True)


@FAST
@given(raw_yaml)
def test_any_yaml_text_is_a_value_or_one_user_error(text):
    check_yaml_text(text)


@FAST
@given(st.lists(raw_yaml, max_size=3))
def test_any_set_override_is_a_value_or_a_problem_that_prints(overrides):
    check_overrides(overrides)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "model.yaml"
    path.write_text(yaml.safe_dump(demo_config()))
    assert invoke_cli(["plan", str(path), "--profile", "rtx3070"]).exit_code == 0  # imports, once
    return path


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["train.seq_len", "model.name_or_path", "data.chat_template", "bogus"]), value=raw_yaml,
       tail=raw_yaml)
def test_the_cli_exits_0_or_2_without_a_traceback(tiny, tmp_path_factory, key, value, tail):
    path = tmp_path_factory.mktemp("fuzz") / "model.yaml"
    path.write_bytes(tiny.read_bytes() + tail.encode("utf-8", errors="surrogatepass"))
    start = time.perf_counter()
    invoke_cli(["plan", str(path), "--profile", "rtx3070", "--set", f"{key}={value}"])
    assert time.perf_counter() - start < 10
