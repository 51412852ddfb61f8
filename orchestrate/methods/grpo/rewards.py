"""The reward functions of a GRPO run (config.py `rewards`), all with TRL's signature
f(prompts, completions, **columns) -> one float per completion (huggingface/trl, GRPOTrainer's
`reward_funcs`), and their weighted sum. The built-in ones need no code; your own is imported only
behind model.trust_remote_code (methods/custom/module.py `import_object`). A reward that raises or
returns the wrong shape is one UserError naming it."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem, UserError
from orchestrate.methods.custom.module import import_object
from orchestrate.methods.grpo.config import RewardSection

RewardFunction = Callable[..., Sequence[float]]
"""f(prompts=[...], completions=[...], completion_tokens=[...], **columns) -> a float per completion."""


def _text(value: Any) -> str:
    return str(value).strip()


def exact_match(column: str, pattern: str | None) -> RewardFunction:
    """1.0 where the answer (the completion, or `pattern`'s first group in it) equals the column's."""
    compiled = re.compile(pattern) if pattern else None

    def reward(prompts, completions, **columns):
        out = []
        for completion, expected in zip(completions, columns[column], strict=True):
            answer = completion
            if compiled is not None:
                found = compiled.search(completion)
                answer = None if found is None else found.group(1 if compiled.groups else 0)
            out.append(float(answer is not None and _text(answer) == _text(expected)))
        return out

    return reward


def format_match(pattern: str) -> RewardFunction:
    compiled = re.compile(pattern)

    def reward(prompts, completions, **columns):
        return [float(compiled.search(c) is not None) for c in completions]

    return reward


def length_penalty(target: int) -> RewardFunction:
    def reward(prompts, completions, completion_tokens, **columns):
        return [-max(0, n - target) / target for n in completion_tokens]

    return reward


def reward_function(section: RewardSection, config: RunConfig) -> RewardFunction:
    if section.kind == "exact_match":
        return exact_match(section.column, section.pattern)
    if section.kind == "format":
        return format_match(section.pattern)
    if section.kind == "length":
        return length_penalty(section.target_tokens)
    return import_object(section.function, "grpo.rewards.function", config)


def reward_functions(config: RunConfig) -> list[tuple[RewardSection, RewardFunction]]:
    """Every configured reward with its function (your own imported here: UserError without the opt-in)."""
    return [(section, reward_function(section, config)) for section in config.grpo.rewards]


def score(rewards: list[tuple[RewardSection, RewardFunction]], prompts: list[Any], completions: list[str],
          completion_tokens: list[int], columns: dict[str, list[Any]]) -> list[list[float]]:
    """Per reward, one float per completion; a UserError naming the reward that raised, or returned
    anything but one finite number per completion."""
    out = []
    for section, function in rewards:
        where = f"grpo.rewards ({section.label})"
        try:
            raw = function(prompts=prompts, completions=completions, completion_tokens=completion_tokens,
                           **columns)
        except Exception as exc:  # noqa: BLE001 - a reward function is the user's to fix
            raise UserError(f"the reward {section.label} failed", [Problem(
                where, f"it raised {type(exc).__name__}: {exc}",
                "fix the function; it is called as f(prompts=[...], completions=[...], **columns)")]) from exc
        try:
            values = [float(v) for v in raw]
        except (TypeError, ValueError):
            values = None
        if values is None or len(values) != len(completions) or not all(math.isfinite(v) for v in values):
            size = f" of {len(raw)}" if hasattr(raw, "__len__") else ""
            raise UserError(f"the reward {section.label} returned the wrong shape", [Problem(
                where, f"it returned a {type(raw).__name__}{size} for {len(completions)} completions, "
                "not one finite float each",
                "return a list with one float per completion, in their order")])
        out.append(values)
    return out
