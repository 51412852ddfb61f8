"""Hostile or malformed model.yaml files (alias bombs, deep nesting, huge files, duplicate keys, bad
bytes, syntax errors) are refused with one UserError naming the line, in bounded time and memory."""

from __future__ import annotations

import resource
import textwrap
import time

import pytest

from orchestrate.config.load import load_config
from orchestrate.errors import UserError
from tests.helpers.configs import MINIMAL


def write(tmp_path, text: str | bytes, name="model.yaml"):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(textwrap.dedent(text))
    return path


def refused(path, overrides=()) -> UserError:
    with pytest.raises(UserError) as info:
        load_config(path, overrides)
    for problem in info.value.problems:
        assert problem.fix, f"problem without a fix line: {problem}"
    return info.value


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_billion_laughs_is_refused_fast_with_the_line(tmp_path):
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        refs = ",".join([f"*a{i - 1}"] * 9)
        lines.append(f"a{i}: &a{i} [{refs}]")
    path = write(tmp_path, MINIMAL + "\n".join(lines) + "\n")
    before, start = _rss_mb(), time.monotonic()
    err = refused(path)
    assert time.monotonic() - start < 5
    assert _rss_mb() - before < 200
    assert "aliases" in str(err) and "line" in err.problems[0].where


def test_many_plain_keys_are_refused_by_the_value_count_without_blaming_aliases(tmp_path):
    path = write(tmp_path, MINIMAL + "".join(f"k{i}: 1\n" for i in range(60_000)))
    err = refused(path)
    assert "holds more than 100,000 values (keys, items and scalars) by this line" in str(err)
    assert "aliases" not in str(err) and "not a data file" in err.problems[0].fix
    # Refused where the count passes 100,000 (two values a key, near key 50,000), not at the end of the
    # file (line 60,005) after parsing the other 10,000 keys.
    line = int(err.problems[0].where.removeprefix(f"{path} (line ").removesuffix(")"))
    assert 49_900 < line < 50_100


def test_recursive_alias_is_refused(tmp_path):
    err = refused(write(tmp_path, MINIMAL + "x: &x [*x]\n"))
    assert "contains it" in str(err)


def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path):
    path = write(tmp_path, MINIMAL + "x: " + "[" * 20_000 + "]" * 20_000 + "\n")
    err = refused(path)
    assert "nesting deeper" in str(err)


def test_huge_file_is_refused_before_parsing(tmp_path):
    path = write(tmp_path, MINIMAL + "# " + "x" * (50 * 2**20) + "\n")
    start = time.monotonic()
    err = refused(path)
    assert time.monotonic() - start < 2
    assert "too large" in str(err)


def test_duplicate_keys_are_refused_with_both_lines(tmp_path):
    err = refused(write(tmp_path, MINIMAL + "train:\n  seq_len: 64\n"))
    assert "duplicate key 'train'" in str(err) and "first on line 3" in str(err)


def test_merge_keys_may_override(tmp_path):
    text = MINIMAL.replace("train:\n  seq_len: 128\n  global_batch_size: 8\n",
                           "base: &base {seq_len: 128, global_batch_size: 8}\n")
    text = text.replace("base:", "x-unused:") + "train:\n  <<: *base\n  seq_len: 64\n"
    with pytest.raises(UserError) as info:  # x-unused is an unknown key; seq_len override is not a duplicate
        load_config(write(tmp_path, text))
    assert "duplicate" not in str(info.value)
    assert "x-unused" in str(info.value)


def test_non_utf8_byte_reports_its_offset(tmp_path):
    raw = MINIMAL.encode() + b"# caf\xe9\n"
    err = refused(write(tmp_path, raw))
    offset = len(MINIMAL.encode()) + len(b"# caf")
    assert f"byte offset {offset}" in str(err) and "line 6" in str(err)


def test_yaml_syntax_error_has_a_fix_and_line(tmp_path):
    err = refused(write(tmp_path, MINIMAL + "x: [1, 2\n"))
    assert "line" in err.problems[0].where


def test_exponent_floats_without_a_dot_are_floats(tmp_path):
    config = load_config(write(tmp_path, MINIMAL + "  optimizer: {lr: 3e-4}\n"), ["train.optimizer.eps=1e-6"])
    assert config.train.optimizer.lr == 3e-4 and config.train.optimizer.eps == 1e-6


def test_hardware_profile_non_utf8_and_duplicates(tmp_path):
    from orchestrate.hardware.presets import load_profile

    bad = tmp_path / "p.yaml"
    bad.write_bytes(b"name: x\n# \xff\n")
    with pytest.raises(UserError) as info:
        load_profile(str(bad))
    assert "byte offset 10" in str(info.value)
    bad.write_text("name: x\nname: y\n")
    with pytest.raises(UserError) as info:
        load_profile(str(bad))
    assert "duplicate key 'name'" in str(info.value)
