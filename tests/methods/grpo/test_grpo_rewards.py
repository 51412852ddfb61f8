"""GRPO's rewards (orchestrate/methods/grpo/rewards.py): the built-in ones against hand values, their
weighted sum, your own function only behind model.trust_remote_code, and one error naming a reward
that raises or returns the wrong shape."""

from __future__ import annotations

import sys

import pytest

from orchestrate.config.load import config_from_dict
from orchestrate.errors import UserError
from orchestrate.methods.grpo.config import RewardSection
from orchestrate.methods.grpo.rewards import reward_functions, score
from orchestrate.methods.registry import method_terms
from orchestrate.model.formulas import shape_from_dict
from tests.helpers.plans import cpu_hardware

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 257, "max_position_embeddings": 64}


def _config(rewards: list[dict], trust: bool = False, **grpo):
    return config_from_dict({"model": {"architecture": dict(LLAMA), "trust_remote_code": trust},
                             "train": {"seq_len": 32, "global_batch_size": 4},
                             "grpo": {"max_completion_length": 8, "rewards": rewards, **grpo}})


def _score(rewards: list[dict], completions: list[str], tokens: list[int], trust: bool = False, **columns):
    config = _config(rewards, trust)
    return score(reward_functions(config), ["p"] * len(completions), completions, tokens, columns)


def test_exact_match_compares_the_completion_or_the_pattern_s_group_with_the_column():
    completions = [" 42 ", "the answer is 42", "41", "answer: 42\nmore"]
    answers = ["42", "42", "42", "42"]
    whole = _score([{"kind": "exact_match", "column": "answer"}], completions, [1] * 4, answer=answers)
    group = _score([{"kind": "exact_match", "column": "answer", "pattern": r"answer:? (?:is )?(\d+)"}],
                   completions, [1] * 4, answer=answers)
    assert whole == [[1.0, 0.0, 0.0, 0.0]]
    assert group == [[0.0, 1.0, 0.0, 1.0]]


def test_format_and_length_rewards_and_their_weighted_sum():
    rewards = [{"kind": "format", "pattern": r"^<a>.*</a>$"}, {"kind": "length", "target_tokens": 4, "weight": 0.5}]
    values = _score(rewards, ["<a>x</a>", "x", "<a>long</a>"], [3, 6, 8])
    assert values == [[1.0, 0.0, 1.0], [0.0, -0.5, -1.0]]


def test_a_reward_s_fields_are_checked_by_kind():
    with pytest.raises(ValueError, match="exact_match reward needs column"):
        RewardSection(kind="exact_match")
    with pytest.raises(ValueError, match="format reward takes no column"):
        RewardSection(kind="format", pattern="x", column="y")


@pytest.fixture
def own_rewards(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def good(prompts, completions, **columns):\n    return [float(len(c)) for c in completions]\n"
        "def raises(prompts, completions, **columns):\n    raise KeyError('solution')\n"
        "def short(prompts, completions, **columns):\n    return [1.0]\n"
        "def text(prompts, completions, **columns):\n    return ['yes' for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_rewards", None)


def test_your_own_reward_function_runs_with_trl_s_signature(own_rewards):
    assert _score([{"kind": "function", "function": "my_rewards:good"}], ["ab", "abc"], [2, 3], trust=True,
                  answer=["x", "y"]) == [[2.0, 3.0]]


def test_your_own_reward_function_needs_the_code_opt_in(own_rewards):
    config = _config([{"kind": "function", "function": "my_rewards:good"}])
    with pytest.raises(UserError) as refused:
        method_terms(config, shape_from_dict(dict(LLAMA)), cpu_hardware(2))
    assert "model.trust_remote_code" in str(refused.value) and "grpo.rewards[0].function" in str(refused.value)


@pytest.mark.parametrize(("function", "said"), [("raises", "it raised KeyError: 'solution'"),
                                                ("short", "it returned a list of 1 for 2 completions"),
                                                ("text", "it returned a list of 2 for 2 completions")])
def test_a_reward_that_raises_or_returns_the_wrong_shape_is_one_error_naming_it(own_rewards, function, said):
    with pytest.raises(UserError) as failed:
        _score([{"kind": "function", "function": f"my_rewards:{function}"}], ["a", "b"], [1, 1], trust=True)
    message = str(failed.value)
    assert f"grpo.rewards ({function})" in message and said in message
