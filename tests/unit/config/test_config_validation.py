"""Strict types and valid ranges for model.yaml fields and --set overrides; every problem has a fix line."""

from __future__ import annotations

import pytest

from orchestrate.config.load import config_from_dict, load_config
from orchestrate.errors import UserError
from tests.helpers.configs import MINIMAL


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(MINIMAL)
    return path


def refused(path, overrides) -> UserError:
    with pytest.raises(UserError) as info:
        load_config(path, overrides)
    for problem in info.value.problems:
        assert problem.fix, f"problem without a fix line: {problem}"
    return info.value


@pytest.mark.parametrize("override, where", [
    ("train.seq_len=true", "train.seq_len"),                    # bool is not an int
    ("train.global_batch_size=8.0", "train.global_batch_size"),  # nor is a float
    ("train.seq_len='128'", "train.seq_len"),                   # nor a quoted string
    ("model.trust_remote_code=1", "model.trust_remote_code"),   # int is not a bool
    ("model.trust_remote_code=yes-please", "model.trust_remote_code"),
    ("model.trust_remote_code='true'", "model.trust_remote_code"),  # str is not a bool
    ("data.packing=0", "data.packing"),
    ("train.optimizer.lr=true", "train.optimizer.lr"),
    ("train.optimizer.betas=[2,3]", "train.optimizer.betas"),
    ("train.optimizer.betas=[0.9,1.0]", "train.optimizer.betas"),
    ("train.optimizer.betas=[-0.1,0.9]", "train.optimizer.betas"),
    ("train.optimizer.betas=[0.9]", "train.optimizer.betas"),
    ("train.optimizer.betas=[true,0.9]", "train.optimizer.betas"),
    ("train.optimizer.lr=.inf", "train.optimizer.lr"),
    ("train.optimizer.eps=.nan", "train.optimizer.eps"),
    ("train.optimizer.weight_decay=-0.1", "train.optimizer.weight_decay"),
    ("train.grad_clip=.inf", "train.grad_clip"),
    ("train.micro_batch_size=0", "train.micro_batch_size"),
    ("train.micro_batch_size=-2", "train.micro_batch_size"),
    ("train.seed=-1", "train.seed"),
    ("train.seed=18446744073709551616", "train.seed"),
    ("train.seq_len=100000000000000000000", "train.seq_len"),
    ("train.global_batch_size=100000000000000000000", "train.global_batch_size"),
    ("train.max_steps=100000000000000000000", "train.max_steps"),
    ("data.validation_ratio=true", "data.validation_ratio"),
    ("strategy.zero_stage=true", "strategy.zero_stage"),
    ("train.activation_checkpointing=1", "train.activation_checkpointing"),
])
def test_wrong_type_or_range_is_refused_with_a_fix(config_file, override, where):
    err = refused(config_file, [override])
    assert any(p.where.startswith(where) for p in err.problems), str(err)


def test_yaml_file_types_are_strict_with_their_line(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(MINIMAL.replace("seq_len: 128", "seq_len: true") + "  optimizer: {betas: [2, 3]}\n")
    err = refused(path, [])
    wheres = [p.where for p in err.problems]
    assert "train.seq_len (line 4)" in wheres and any(w.startswith("train.optimizer.betas") for w in wheres)


def test_override_strings_keep_working(config_file):
    config = load_config(config_file, ["train.seq_len=512", "model.trust_remote_code=true", "train.optimizer.lr=1e-4",
                                       "train.optimizer.betas=[0.8, 0.99]", "train.optimizer.weight_decay=0",
                                       "train.micro_batch_size=2", "strategy.zero_stage=3", "data.num_proc=1"])
    assert config.train.seq_len == 512 and config.model.trust_remote_code is True
    assert config.train.optimizer.lr == 1e-4 and config.train.optimizer.betas == (0.8, 0.99)
    assert config.train.optimizer.weight_decay == 0.0


def test_plan_json_round_trip_still_validates(config_file):
    config = load_config(config_file, ["train.optimizer.betas=[0.8, 0.99]"])
    again = config_from_dict(config.model_dump(mode="json"))
    assert again.train.optimizer.betas == (0.8, 0.99)


@pytest.mark.parametrize("override", ["model.architecture.model_type=[]", "model.architecture.n_layer=1000000",
                                      "model.architecture.n_embd=-4", "model.architecture.n_head=true",
                                      "model.architecture.vocab_size=2.5"])
def test_architecture_dimensions_are_bounded(config_file, override):
    err = refused(config_file, [override])
    key = override.split("=")[0].split(".")[-1]
    assert err.problems[0].where.startswith("model") and f"`{key}`" in err.problems[0].message


def test_architecture_optional_dimension_may_be_null(config_file):
    assert load_config(config_file, ["model.architecture.n_inner=null"]).model.architecture["n_inner"] is None


@pytest.mark.parametrize("word", ["yes", "no", "on", "off", "y", "n"])
def test_yaml_1_1_boolean_words_are_not_booleans(config_file, word):
    err = refused(config_file, [f"model.trust_remote_code={word}"])
    assert "true or false" in err.problems[0].fix


def test_value_errors_get_a_specific_fix(config_file):
    err = refused(config_file, ["train.optimizer.betas=[2, 3]"])
    assert "[0.9, 0.95]" in err.problems[0].fix
