"""Several fake-tensor simulations at once: each is its own subprocess (orchestrate.simulate) and
mostly one core's Python, so two overlap on the 2-core test machine."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def two_at_a_time(fn: Callable[[Any], Any], targets: list[Any]) -> list:
    """`fn(target)` for each target, two at a time, results in order: `simulate` of RunSpecs or plans,
    `verify_plan` of plans."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(fn, targets))
