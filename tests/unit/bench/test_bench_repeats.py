"""bench/repeats.py: the interleaving order and the statistics, on fake measurement functions."""

from __future__ import annotations

import pytest

from bench import repeats


def test_arms_alternate_round_by_round():
    calls: list[str] = []

    def arm(name, values):
        it = iter(values)

        def measure():
            calls.append(name)
            return next(it)
        return measure

    seen = []
    out = repeats.interleave({"a": arm("a", [1, 2, 3]), "b": arm("b", [10, 20, 30])}, 3,
                             on_result=lambda r, n, v: seen.append((r, n, v)))
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert out == {"a": [1, 2, 3], "b": [10, 20, 30]}
    assert seen == [(0, "a", 1), (0, "b", 10), (1, "a", 2), (1, "b", 20), (2, "a", 3), (2, "b", 30)]


def test_spread_is_median_min_max():
    s = repeats.spread([5.0, 1.0, 3.0, 100.0])
    assert (s.median, s.low, s.high, s.n) == (4.0, 1.0, 100.0, 4)
    assert s.format(".1f") == "4.0 (1.0-100.0, n=4)"
    assert s.as_dict() == {"median": 4.0, "min": 1.0, "max": 100.0, "n": 4}


def test_paired_ratio_cancels_drift_shared_by_a_round():
    # The machine slows down 3x over the run; B is always 2x A in the same round.
    a = [1.0, 2.0, 3.0]
    b = [2.0, 4.0, 6.0]
    r = repeats.paired_ratio(a, b)
    assert (r.median, r.low, r.high) == (0.5, 0.5, 0.5)
    # A ratio of medians would also be 0.5 here, but one outlier round moves only the range.
    r = repeats.paired_ratio([1.0, 2.0, 30.0], b)
    assert r.median == 0.5 and r.high == 5.0


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        repeats.interleave({"a": lambda: 1.0}, 0)
    with pytest.raises(ValueError):
        repeats.paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        repeats.spread([])
