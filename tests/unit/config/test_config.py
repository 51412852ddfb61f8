"""The model.yaml schema and loader: valid minimal files, overrides, and one clear error for bad input."""

from __future__ import annotations

import textwrap

import pytest

from orchestrate.config.describe import describe_schema
from orchestrate.config.load import load_config, parse_overrides
from orchestrate.errors import UserError
from tests.helpers.configs import MINIMAL


def write(tmp_path, text, name="model.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_minimal_file_is_valid_for_planning(tmp_path):
    config = load_config(write(tmp_path, MINIMAL))
    assert config.train.seq_len == 128
    assert config.train.micro_batch_size == "auto"
    assert config.strategy.backend == "auto"
    assert config.data.train_files == []
    assert config.source_dir == tmp_path.resolve()


def test_overrides_apply_dotted_paths_with_yaml_values(tmp_path):
    config = load_config(write(tmp_path, MINIMAL), ["train.seq_len=512", "strategy.zero_stage=3",
                                                    "train.optimizer.betas=[0.8, 0.9]", "strategy.offload=cpu"])
    assert config.train.seq_len == 512
    assert config.strategy.zero_stage == 3
    assert config.train.optimizer.betas == (0.8, 0.9)
    assert config.strategy.offload == "cpu"


def test_every_problem_is_reported_at_once_with_path_and_line(tmp_path):
    path = write(tmp_path, """\
        model:
          architecture: {model_type: gpt2}
        train:
          seq_len: -5
          global_batch_size: 8
          micro_batch_size: lots
          precison: bf16
        strategy:
          zero_stage: 7
        """)
    with pytest.raises(UserError) as info:
        load_config(path, ["train.max_steps=abc"])
    text = str(info.value)
    wheres = {p.where for p in info.value.problems}
    assert wheres == {"train.seq_len (line 4)", "train.micro_batch_size (line 6)", "train.precison (line 7)",
                      "strategy.zero_stage (line 9)", "train.max_steps"}
    assert "unknown key" in text and "zero_stage must be 0, 1, 2, 3 or auto" in text
    assert "greater than 0" in text


def test_missing_required_keys_name_the_fix(tmp_path):
    with pytest.raises(UserError) as info:
        load_config(write(tmp_path, "model: {name_or_path: x}\ntrain: {seq_len: 8}\n"))
    (problem,) = info.value.problems
    assert problem.where == "train.global_batch_size"
    assert "missing" in problem.message and "global_batch_size" in problem.fix


def test_model_needs_exactly_one_source(tmp_path):
    with pytest.raises(UserError) as info:
        load_config(write(tmp_path, "model: {}\ntrain: {seq_len: 8, global_batch_size: 8}\n"))
    assert "exactly one of" in str(info.value)
    with pytest.raises(UserError):
        load_config(write(tmp_path, "model: {architecture: {n_embd: 8}}\ntrain: {seq_len: 8, global_batch_size: 8}\n"))


@pytest.mark.parametrize("text, fragment", [
    ("- 1\n- 2\n", "must be a mapping"),
    ("model: {a: 1\n", "not valid YAML"),
])
def test_malformed_files(tmp_path, text, fragment):
    with pytest.raises(UserError, match=fragment):
        load_config(write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="file not found|cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_bad_override_syntax_is_reported():
    parsed, problems = parse_overrides(["train.seq_len=5", "noequals", "=3", "a..b=1"])
    assert parsed == [(["train", "seq_len"], 5)]
    assert len(problems) == 3


def test_resolve_path_is_relative_to_the_yaml(tmp_path):
    config = load_config(write(tmp_path, MINIMAL))
    assert config.resolve_path("data/a.txt") == tmp_path.resolve() / "data/a.txt"
    assert config.resolve_path("/abs/a.txt").as_posix() == "/abs/a.txt"


def test_schema_description_lists_every_section_with_docs():
    text = describe_schema()
    for key in ("model.name_or_path", "train.seq_len", "train.optimizer.lr", "strategy.offload", "data.text_field"):
        assert key in text
    assert "source_dir" not in text
