"""Progress output when stdout is not a terminal: plain lines, every N counts, the last one, and
status changes at most every PLAIN_INTERVAL_S seconds."""

from __future__ import annotations

import grpolab.progress as progress
from grpolab.progress import _PlainBar


def test_plain_lines_every_n_counts_at_the_end_and_throttled_status(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    lines: list[str] = []
    bar = _PlainBar("grpo", 30, start=0, every=10, write=lines.append)
    for step in range(1, 31):
        now[0] += 2.0
        bar.update(step, f"reward {step / 30:.2f}")
    counted = [line for line in lines if line.startswith(("grpo 10/", "grpo 20/", "grpo 30/"))]
    assert [line.split()[1] for line in counted] == ["10/30", "20/30", "30/30"]
    assert "2.0 s/it" in counted[0] and "eta 40s" in counted[0] and "eta" not in counted[-1]
    assert all("..." not in line and "\u2026" not in line for line in lines)  # never truncated
    # status-only updates (an evaluation inside a step) print at most every PLAIN_INTERVAL_S
    before = len(lines)
    for i in range(100):
        now[0] += 1.0
        bar.update(30, f"eval {i}/100")
    assert 1 <= len(lines) - before <= 100 / progress.PLAIN_INTERVAL_S + 1


def test_disabled_bar_prints_nothing(capsys):
    with progress.progress_bar("x", 5, enabled=False) as bar:
        bar.update(5, "done")
    assert capsys.readouterr().out == ""


def test_not_a_terminal_gives_plain_lines(capsys):
    with progress.progress_bar("eval", 4, every=2) as bar:  # pytest's captured stdout is not a terminal
        for i in range(1, 5):
            bar.update(i)
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out if line.startswith("eval ")][-2:] == ["2/4", "4/4"]
