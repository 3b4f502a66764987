"""Progress a driver updates with a count and a short status string.

On a terminal it is a rich bar whose status column wraps rather than truncating to ellipses on
narrow (80-column) terminals. When stdout is not a terminal (a log file, CI, a batch job) a bar
would only be drawn at the end, so it prints plain lines instead: one every ``every`` counts, at
the last count, whenever the caller forces one (an evaluation), and otherwise at most every
``PLAIN_INTERVAL_S`` seconds while the status changes (evaluation and sampling inside a long step).
"""

from __future__ import annotations

import contextlib
import sys
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column

PLAIN_INTERVAL_S = 30.0


def _fmt_duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class _Bar:
    def __init__(self, progress: Progress | None, task):
        self._progress, self._task = progress, task

    def update(self, completed: int, status: str = "", force: bool = False) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, status=status)


class _PlainBar:
    """Lines such as ``step 50/500  reward 0.41 ...  2.1 s/step  eta 15m45s`` for non-terminals."""

    def __init__(self, label: str, total: int, start: int, every: int, write, unit: str = "it"):
        self.label, self.total, self.every, self.write, self.unit = label, total, max(every, 1), write, unit
        self.start, self.t0, self.last_count, self.last_print = start, time.perf_counter(), start, 0.0

    def update(self, completed: int, status: str = "", force: bool = False) -> None:
        now = time.perf_counter()
        new = completed != self.last_count
        self.last_count = completed
        due = force or (new and (completed % self.every == 0 or completed == self.total))
        if not due and now - self.last_print < PLAIN_INTERVAL_S:
            return
        self.last_print = now
        line = f"{self.label} {completed}/{self.total}"
        if status:
            line += f"  {status}"
        done = completed - self.start
        if done > 0:
            per = (now - self.t0) / done
            u = self.unit
            line += (
                f"  {1 / per:.1f} {u}/s"
                if per < 1
                else f"  {per:.1f} s/{u}"
                if per < 100
                else f"  {_fmt_duration(per)}/{u}"
            )
            if completed < self.total:
                line += f"  eta {_fmt_duration(per * (self.total - completed))}"
        self.write(line)


def _rich_progress(label: str, console=None) -> Progress:
    fixed = dict(table_column=Column(no_wrap=True))  # these never shrink; the status column wraps
    return Progress(
        TextColumn(f"[bold]{label}", **fixed),
        BarColumn(bar_width=20, **fixed),
        MofNCompleteColumn(**fixed),
        TimeElapsedColumn(**fixed),
        TimeRemainingColumn(**fixed),
        TextColumn("{task.fields[status]}", table_column=Column(ratio=1, overflow="fold")),
        console=console,
    )


@contextlib.contextmanager
def progress_bar(label: str, total: int, *, enabled: bool = True, start: int = 0, every: int = 10, unit: str = "it"):
    """A bar (terminal) or plain lines (otherwise); ``every``: counts between plain lines; ``unit``: what one count is."""
    if not enabled:
        yield _Bar(None, None)
        return
    if not sys.stdout.isatty():
        yield _PlainBar(label, total, start, every, lambda line: print(line, flush=True), unit)
        return
    progress = _rich_progress(label)
    with progress:
        task = progress.add_task(label, total=total, completed=start, status="")
        yield _Bar(progress, task)
