"""Interleaved repeats and their statistics, shared by every benchmark in bench/ that prints a ratio.

Why interleaved: on a shared machine the load drifts over minutes, so A A A B B B compares A's
quiet minute with B's busy one. Running A B A B ... puts each pair of measurements next to each
other in time; the ratio of each round's pair (paired ratio) cancels the drift that both saw, and
the median over rounds ignores a round spoilt by a burst of load. The min-max spread is printed
next to every median so a reader sees how far one run can be from another.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Spread:
    """Median and range of repeated measurements."""

    median: float
    low: float
    high: float
    n: int

    def format(self, fmt: str = ".3f") -> str:
        return f"{self.median:{fmt}} ({self.low:{fmt}}-{self.high:{fmt}}, n={self.n})"

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.low, "max": self.high, "n": self.n}


def spread(values: Sequence[float]) -> Spread:
    if not values:
        raise ValueError("no measurements")
    return Spread(statistics.median(values), min(values), max(values), len(values))


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Spread:
    """Spread of numerator[i] / denominator[i]: the ratio within each interleaved round."""
    if len(numerator) != len(denominator):
        raise ValueError(f"{len(numerator)} vs {len(denominator)} measurements: not paired")
    return spread([a / b for a, b in zip(numerator, denominator, strict=True)])


def interleave(arms: Mapping[str, Callable[[], T]], repeats: int,
               on_result: Callable[[int, str, T], None] | None = None) -> dict[str, list[T]]:
    """Call every arm once per round, in the mapping's order, for `repeats` rounds (A B A B ...).

    Returns each arm's results in round order, so results[a][i] and results[b][i] are a pair.
    `on_result(round, name, value)` sees each result as it arrives (progress output).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    results: dict[str, list[T]] = {name: [] for name in arms}
    for round_ in range(repeats):
        for name, measure in arms.items():
            value = measure()
            results[name].append(value)
            if on_result is not None:
                on_result(round_, name, value)
    return results
