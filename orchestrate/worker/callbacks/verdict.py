"""Prints the memory verdict (`orchestrate/report/verdict.py`) at the end of a run, on rank 0."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orchestrate.report.verdict import memory_verdict

if TYPE_CHECKING:
    from orchestrate.worker.callbacks.base import RunInfo, StepEnd


class MemoryVerdictPrinter:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def on_train_start(self, run: RunInfo) -> None:
        self.records = []

    def on_step_end(self, run: RunInfo, end: StepEnd) -> None:
        record = end.record
        if run.is_main:
            self.records.append(record)

    def on_train_end(self, run: RunInfo, stopped_early: bool) -> None:
        if run.is_main and self.records:
            print(memory_verdict(self.records, run.plan).text(), flush=True)
