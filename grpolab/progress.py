"""A progress bar (rich) that a driver updates with a short status string."""

from __future__ import annotations

import contextlib

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class _Bar:
    def __init__(self, progress: Progress | None, task):
        self._progress, self._task = progress, task

    def update(self, completed: int, status: str = "") -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, status=status)


@contextlib.contextmanager
def progress_bar(label: str, total: int, *, enabled: bool = True, start: int = 0):
    if not enabled:
        yield _Bar(None, None)
        return
    progress = Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
    )
    with progress:
        task = progress.add_task(label, total=total, completed=start, status="")
        yield _Bar(progress, task)
