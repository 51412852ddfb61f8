"""One collective per step: the stop flag rides on the step stats' all-gather (worker/loop.py).

The two-rank agreement itself is exercised end to end by tests/e2e/test_fault_tolerance.py (a SIGTERM
to one rank checkpoints every rank at the same step); here the single-process pieces.
"""

from __future__ import annotations

import os
import signal

import torch

from orchestrate.worker.metrics import gather_step_stats
from orchestrate.worker.signals import StopRequest


def test_stats_gather_carries_the_stop_values_and_decide_matches_agreed():
    cpu = torch.device("cpu")
    stop = StopRequest().install()
    try:
        stats = gather_step_stats(2.5, 0, cpu, stop.local(None))
        assert stats["stop_max"] == (-1.0, -1.0)
        assert StopRequest.decide(*stats["stop_max"]) == (False, 0.0, None) == stop.agreed(cpu, None)
        assert stats["loss"] == 2.5  # the stats themselves are unchanged

        os.kill(os.getpid(), signal.SIGUSR1)
        stats = gather_step_stats(2.5, 0, cpu, stop.local(3.0))
        stopping, waited, save_s = StopRequest.decide(*stats["stop_max"])
        assert stopping and waited >= 0 and save_s == 3.0
        assert stop.agreed(cpu, 3.0)[0] and stop.agreed(cpu, 3.0)[2] == 3.0
    finally:
        stop.uninstall()


def test_stats_without_stop_values_default_to_no_signal():
    stats = gather_step_stats(1.0, 0, torch.device("cpu"))
    assert StopRequest.decide(*stats["stop_max"]) == (False, 0.0, None)
