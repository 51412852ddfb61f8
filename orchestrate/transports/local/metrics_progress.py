"""On a terminal, a rich progress bar fed by RUN_DIR/metrics.jsonl while the workers run."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from orchestrate.planner.plan import RunPlan
from orchestrate.report.progress_text import memory_and_mfu
from orchestrate.run.layout import METRICS_FILE

if TYPE_CHECKING:
    from rich.console import Console


@contextmanager
def follow_metrics(plan: RunPlan, run_dir: Path, console: Console | None):
    """On a terminal, a rich progress bar fed by RUN_DIR/metrics.jsonl while the workers run
    (their own output is a log file, so rank 0 prints plain lines, shown above the bar)."""
    if console is None or not console.is_terminal:
        yield
        return

    total = plan.config.train.max_steps  # None for train.num_epochs: the workers resolve it, the bar counts up
    bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=console)
    task = bar.add_task("train", total=total, status="starting workers")
    stop = threading.Event()

    def poll() -> None:
        path, offset = run_dir / METRICS_FILE, 0
        while not stop.wait(0.5):
            if not path.exists():
                continue
            if path.stat().st_size < offset:  # a relaunch in the same directory restarted the file
                offset = 0
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next poll
            offset += len(complete)
            for line in complete.decode().splitlines():
                rec = json.loads(line)
                status = f"loss {rec['loss']:.4f}  {rec['tokens_per_s']:,.0f} tok/s  {memory_and_mfu(rec, plan)}"
                bar.update(task, completed=rec["step"], status=status)

    thread = threading.Thread(target=poll, name="orchestrate-progress", daemon=True)
    with bar:
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
