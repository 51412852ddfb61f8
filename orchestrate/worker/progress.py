"""Rank 0's progress display: a rich bar on a terminal, plain lines when stdout is a file or pipe
(torchrun's log files, CI logs, `| tee`), so logs stay readable."""

from __future__ import annotations

import sys
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def _fmt_step(step: int, max_steps: int, loss: float, tokens_per_s: float, eta_s: float,
              eval_loss: float | None, extra: str = "") -> str:
    text = f"step {step}/{max_steps}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  eta {eta_s:.0f}s"
    if eval_loss is not None:
        text += f"  eval_loss {eval_loss:.4f}"
    return text + (f"  {extra}" if extra else "")


class ProgressDisplay:
    def __init__(self, max_steps: int, enabled: bool, interactive: bool | None = None):
        self.max_steps = max_steps
        self.enabled = enabled
        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        # About 20 plain lines per run, plus the first and the last step and every evaluation.
        self.every = max(1, max_steps // 20)
        self._start = time.perf_counter()
        self._bar = None
        if enabled and self.interactive:
            self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[status]}"), TimeRemainingColumn())
            self._task = self._bar.add_task("train", total=max_steps, status="")
            self._bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float, eval_loss: float | None = None,
               extra: str = "") -> None:
        """`extra`: more of the step to show (memory and MFU, `report.progress_text`)."""
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self._start
        eta = elapsed / step * (self.max_steps - step)
        if self._bar is not None:
            status = f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s" + (f"  {extra}" if extra else "")
            self._bar.update(self._task, completed=step, status=status)
            if eval_loss is not None:
                self._bar.console.print(f"step {step}: eval_loss {eval_loss:.4f}")
        elif step in (1, self.max_steps) or step % self.every == 0 or eval_loss is not None:
            print(_fmt_step(step, self.max_steps, loss, tokens_per_s, eta, eval_loss, extra), flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
