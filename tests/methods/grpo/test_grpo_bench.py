"""bench/grpo_learning.py --short (slow): the SFT run, the held-out evaluation of its model, and both
GRPO arms run through the launcher, and the table has one row: the three exact-match rates and the
rewarded run's share of groups without a signal (frac_reward_zero_std)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_grpo_learning_short_prints_a_row_of_three_rates_and_the_zero_std_share(tmp_path, capsys):
    from bench.grpo_learning import main

    main(["--short", "--work", str(tmp_path)])
    (row,) = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("   0")]
    assert row[0] == "0" and len(row) == 5
    assert all(0.0 <= float(share) <= 1.0 for share in row[1:])
