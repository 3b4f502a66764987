"""Reading the JSON-lines files a run writes (metrics, samples, rollouts, token credit), which a killed run can leave
with a last line cut short: each line a record if a check accepts it, else one reason why it was skipped."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def read_jsonl(path: Path, check: Callable[[object], str | None]) -> tuple[list[dict], list[str]]:
    """The objects of a JSON-lines file that ``check`` accepts, and one reason per line skipped."""
    kept, skipped = [], []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            skipped.append(f"line {n}: not JSON ({e.msg})")
            continue
        problem = check(obj)
        if problem is None:
            kept.append(obj)
        else:
            skipped.append(f"line {n}: {problem}")
    return kept, skipped


def step_record(obj: object) -> str | None:
    """A check for :func:`read_jsonl`: None for an object with an integer ``step`` (a run's row), else why not."""
    return None if isinstance(obj, dict) and isinstance(obj.get("step"), int) else "not a record with a step"
