"""Progress output when stdout is not a terminal: plain lines, every N counts, the last one, and
status changes at most every PLAIN_INTERVAL_S seconds."""

from __future__ import annotations

import pytest

import grpolab.common.progress as progress
from grpolab.common.progress import _PlainBar


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


def test_forced_line_at_an_evaluation_between_counts():
    lines: list[str] = []
    bar = _PlainBar("step", 20, start=0, every=10, write=lines.append, unit="step")
    for step in range(1, 21):
        bar.update(step, "eval greedy 0.5" if step == 5 else "reward 0.1", force=step == 5)
    # the first update prints at once (nothing printed for PLAIN_INTERVAL_S), then every 10 and the forced one
    assert [line.split()[1] for line in lines] == ["1/20", "5/20", "10/20", "20/20"]
    assert "eval greedy 0.5" in lines[1] and ("s/step" in lines[2] or "step/s" in lines[2])


def test_terminal_bar_wraps_its_status_instead_of_truncating_at_80_columns():
    from rich.console import Console

    console = Console(width=80, force_terminal=True, color_system=None, record=True)
    p = progress._rich_progress("step", console=console)
    status = "reward 0.412  acc 0.336  eval greedy 0.574 sampled 0.221"
    p.add_task("step", total=500, completed=50, status=status)
    console.print(p.make_tasks_table(p.tasks))
    text = console.export_text()
    assert "\u2026" not in text and "50/500" in text
    assert " ".join(text.split()).endswith(" ".join(status.split()))  # every word of the status is shown


@pytest.mark.slow
def test_train_with_stdout_to_a_file_logs_every_n_steps_and_each_evaluation(tmp_path):
    from helpers.cli import run_main  # in this process: its stdout a captured stream, not a terminal, as a file is

    res = run_main(
        ["train", "--steps", "7", "--log-every", "3", "--eval-every", "5", "--eval-questions", "8"]
        + ["--eval-samples", "1", "--prompts-per-step", "2", "--group-size", "2", "--out", str(tmp_path / "run")],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    log = tmp_path / "log.txt"
    log.write_text(res.stdout)
    lines = log.read_text().splitlines()
    steps = [line.split()[1] for line in lines if line.startswith("step ")]
    assert steps == ["0/7", "3/7", "5/7", "6/7", "7/7"], lines  # 0/7: the first evaluation's progress
    assert lines[0].startswith("loading builtin")
    assert any(line.startswith("eval at step 5:") for line in lines)
    five = next(line for line in lines if line.startswith("step 5/7"))
    assert "eval greedy" in five and ("s/step" in five or "step/s" in five) and "eta" in five


@pytest.mark.slow
def test_a_command_run_in_this_process_past_its_deadline_fails_naming_it(tmp_path):
    import os

    from helpers.cli import RanPastDeadline, run_main

    here = os.getcwd()
    with pytest.raises(RanPastDeadline, match=r"grpolab train --steps 500 .* still running after 2 s"):
        run_main(["train", "--steps", "500", "--nproc", "1", "--out", str(tmp_path / "run")], tmp_path, timeout=2)
    assert os.getcwd() == here  # put back, as after any command
