"""Properties of the YAML and `--set` parser over raw text (YAML syntax, control characters, lone
surrogates from undecodable argv bytes, aliases, deep nesting): the result is a value or one
UserError, never another exception, in bounded time; and through the CLI, exit 0 or 2 without a
traceback."""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrate.cli import cli
from orchestrate.config import safe_yaml
from orchestrate.config.load import parse_overrides
from orchestrate.errors import UserError

ROOT = Path(__file__).resolve().parents[3]
FAST = settings(max_examples=60, deadline=None, derandomize=True)
SECONDS_PER_EXAMPLE = 2.0

raw = st.lists(st.sampled_from([
    "a", "train", ".", "seq_len", ":", " ", "\n", "\t", "-", "[", "]", "{", "}", ",", "&x", "*x", "!!str", "!!python/name:os.system",
    "'", '"', "#", "|", ">", "?", "%YAML 1.1\n", "---", "...", "<<: *x", "1e3", "yes", "0x1F", "\x00", "\x01", "\x07",
    "\x1b[31m", "\x7f", "\x85", "\u2028", "\ufeff", "\ud800", "\udce9", "é", "🙂", "=", "\\", "\\x01", "[" * 80,
]), max_size=16).map("".join)


@FAST
@given(raw)
def test_any_yaml_text_is_a_value_or_one_user_error(text):
    start = time.perf_counter()
    try:
        safe_yaml.parse(text, "model.yaml")
    except UserError as exc:
        assert exc.problems and all(p.where.startswith("model.yaml") for p in exc.problems)
    assert time.perf_counter() - start < SECONDS_PER_EXAMPLE


@FAST
@given(st.lists(raw, max_size=3))
def test_any_set_override_is_a_value_or_a_problem_that_prints(overrides):
    start = time.perf_counter()
    parsed, problems = parse_overrides(overrides)
    assert len(parsed) + len(problems) >= len(overrides)
    for problem in problems:
        problem.render().encode("utf-8")  # printable: no lone surrogate reaches the terminal
    assert time.perf_counter() - start < SECONDS_PER_EXAMPLE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "model.yaml"
    base = yaml.safe_load((ROOT / "examples" / "tiny-gpt2.yaml").read_text())
    base.pop("data", None)
    path.write_text(yaml.safe_dump(base))
    assert CliRunner().invoke(cli, ["plan", str(path), "--profile", "rtx3070"]).exit_code == 0  # imports, once
    return path


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["train.seq_len", "model.name_or_path", "data.chat_template", "bogus"]), value=raw,
       tail=raw)
def test_the_cli_exits_0_or_2_without_a_traceback(tiny, tmp_path_factory, key, value, tail):
    path = tmp_path_factory.mktemp("fuzz") / "model.yaml"
    path.write_bytes(tiny.read_bytes() + tail.encode("utf-8", errors="surrogatepass"))
    start = time.perf_counter()
    result = CliRunner().invoke(cli, ["plan", str(path), "--profile", "rtx3070", "--set", f"{key}={value}"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        pytest.fail("".join(traceback.format_exception(result.exception))[-3000:])
    assert result.exit_code in (0, 2), result.output[-2000:]
    assert "Traceback" not in result.output
    assert time.perf_counter() - start < 10
