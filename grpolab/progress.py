"""Progress a driver updates with a count and a short status string.

On a terminal it is a rich bar. When stdout is not a terminal (a log file, CI, a batch job) a
bar would only be drawn at the end, so it prints plain lines instead: one every ``every``
counts, at the last count, and otherwise at most every ``PLAIN_INTERVAL_S`` seconds while the
status changes (evaluation and sampling inside a long step).
"""

from __future__ import annotations

import contextlib
import sys
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

PLAIN_INTERVAL_S = 30.0


def _fmt_duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class _Bar:
    def __init__(self, progress: Progress | None, task):
        self._progress, self._task = progress, task

    def update(self, completed: int, status: str = "") -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, status=status)


class _PlainBar:
    """Lines such as ``grpo 50/500  reward 0.41 ...  2.1 s/it  eta 15m45s`` for non-terminals."""

    def __init__(self, label: str, total: int, start: int, every: int, write):
        self.label, self.total, self.every, self.write = label, total, max(every, 1), write
        self.start, self.t0, self.last_count, self.last_print = start, time.perf_counter(), start, 0.0

    def update(self, completed: int, status: str = "") -> None:
        now = time.perf_counter()
        new = completed != self.last_count
        self.last_count = completed
        due = new and (completed % self.every == 0 or completed == self.total)
        if not due and now - self.last_print < PLAIN_INTERVAL_S:
            return
        self.last_print = now
        line = f"{self.label} {completed}/{self.total}"
        if status:
            line += f"  {status}"
        done = completed - self.start
        if done > 0:
            per = (now - self.t0) / done
            line += f"  {1 / per:.1f} it/s" if per < 1 else f"  {per:.1f} s/it" if per < 100 else f"  {_fmt_duration(per)}/it"
            if completed < self.total:
                line += f"  eta {_fmt_duration(per * (self.total - completed))}"
        self.write(line)


@contextlib.contextmanager
def progress_bar(label: str, total: int, *, enabled: bool = True, start: int = 0, every: int = 10):
    """A bar (terminal) or plain lines (otherwise); ``every``: counts between plain lines."""
    if not enabled:
        yield _Bar(None, None)
        return
    if not sys.stdout.isatty():
        yield _PlainBar(label, total, start, every, lambda line: print(line, flush=True))
        return
    progress = Progress(
        TextColumn(f"[bold]{label}"), BarColumn(bar_width=20), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
    )
    with progress:
        task = progress.add_task(label, total=total, completed=start, status="")
        yield _Bar(progress, task)
