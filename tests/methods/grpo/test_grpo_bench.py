"""bench/grpo_learning.py --short (slow): the SFT run, the held-out evaluation of its model, and both
GRPO arms run through the launcher, and the table has one row with the three exact-match rates."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_grpo_learning_short_prints_a_row_of_three_rates(tmp_path, capsys):
    from bench.grpo_learning import main

    main(["--short", "--work", str(tmp_path)])
    (row,) = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("   0")]
    assert row[0] == "0" and len(row) == 4
    assert all(0.0 <= float(rate) <= 1.0 for rate in row[1:])
