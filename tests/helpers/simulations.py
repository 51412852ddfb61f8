"""Several fake-tensor simulations at once: each is its own subprocess (orchestrate.simulate.simulate)
and mostly one core's Python, so two overlap on the 2-core test machine."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any


def simulate_all(targets: list[Any], jobs: int = 2) -> list:
    """`simulate(target)` for each (a RunSpec or a plan), in order."""
    from orchestrate.simulate import simulate

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(simulate, targets))
