"""Property: whatever YAML and `--set` overrides `orchestrate plan` gets, it exits 0 or 2 with no
traceback, in bounded time and memory. Cases are mutations of the tiny GPT-2 demo's config: wrong
types, huge and negative numbers, unicode, deep nesting, aliases (tests/helpers/input_fuzz.py's
`plan_cases`, which bench/fuzz.py runs longer)."""

from __future__ import annotations

import resource

import pytest
from hypothesis import HealthCheck, given, settings

from tests.helpers.input_fuzz import plan_cases, plan_surface


@pytest.fixture(scope="module")
def surface(tmp_path_factory):
    """One plan first, in the fixture: the imports (transformers, the planner) must not count against
    the deadline."""
    return plan_surface(tmp_path_factory.mktemp("plan"))


@settings(max_examples=150, deadline=3000, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=plan_cases)
def test_plan_exits_0_or_2_without_a_traceback(surface, case):
    surface.check(case)


def test_memory_stayed_bounded():
    # ru_maxrss is this process's peak (KiB on Linux): the fuzz cases above ran in it.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 4 * 2**20, "peak RSS above 4 GiB"
