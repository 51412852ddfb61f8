"""Prints the memory verdict (`orchestrate/report/memory_verdict.py`) at the end of a run, on rank 0."""

from __future__ import annotations

from typing import Any

from orchestrate.report.memory_verdict import memory_verdict
from orchestrate.worker.callbacks.base import Callback, StepEnd, Training


class MemoryVerdictPrinter(Callback):
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def on_train_start(self, training: Training) -> None:
        self.records = []

    def on_step_end(self, training: Training, end: StepEnd) -> None:
        record = end.record
        if training.rank.is_main:
            self.records.append(record)

    def on_train_end(self, training: Training, stopped_early: bool) -> None:
        if training.rank.is_main and self.records:
            print(memory_verdict(self.records, training.plan).text(), flush=True)
