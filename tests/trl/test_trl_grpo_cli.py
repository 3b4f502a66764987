"""benchmarks/trl_dropin/trl_grpo_cli.py's reading of each side's steps: TRL's console log, where tqdm's progress bar
shares lines with the log dicts, and grpolab's metrics.jsonl."""

from __future__ import annotations

import importlib.util
import json

from helpers.paths import REPO

ROOT = REPO


def _script():
    spec = importlib.util.spec_from_file_location("trl_grpo_cli", ROOT / "benchmarks/trl_dropin/trl_grpo_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _entry(step_time: str, frac: str, std: str) -> str:
    return str({"loss": "0.01", "reward_std": std, "frac_reward_zero_std": frac, "step_time": step_time, "epoch": "1"})


def test_trl_steps_are_read_where_the_progress_bar_shares_their_line():
    cli = _script()
    bar = "\r 25%|██▌       | 1/4 [00:21<01:03, 21.2s/it]"
    log = "".join([
        "loading the model ...\n",
        "  0%|          | 0/4 [00:00<?, ?it/s]" + bar + _entry("21.2", "0.5", "0.3") + "\n",  # the bar first
        _entry("20.1", "1", "0") + "\r\n",  # alone on its line, a carriage return before the newline
        bar + " " + _entry("19.5", "0", "0.4") + bar + "\n",  # between two draws of the bar
        "\r 75%|███████▌  | 3/4 [01:02<00:20, 20.4s/it]" + _entry("18.0", "0.25", "0.2"),  # the last line, no newline
        "\n" + str({"train_runtime": "80.1", "train_loss": "0.01"}) + "\n",  # the run's summary: no step
    ])  # fmt: skip
    steps = cli.trl_steps(log)
    assert [s.seconds for s in steps] == [21.2, 20.1, 19.5, 18.0]
    assert [s.signal for s in steps] == [True, False, True, True]


def test_grpolab_steps_and_their_signal():
    cli = _script()
    rows = [
        {"step": 0, "eval/greedy": 0.5},  # the step-0 evaluation: no step time
        {"step": 1, "time/step_s": 6.0, "reward/frac_zero_std": 1.0, "reward/std": 0.0},
        {"step": 2, "time/step_s": 5.5, "reward/frac_zero_std": 0.5, "reward/std": 0.3},
        {"step": 3, "time/step_s": 5.0, "reward/std": 0.1},  # no frac: the std decides
    ]
    steps = cli.grpolab_steps("".join(json.dumps(r) + "\n" for r in rows))
    assert [(s.seconds, s.signal) for s in steps] == [(6.0, False), (5.5, True), (5.0, True)]
    assert cli.trl_steps("no dict here\r 10%|█ | 1/10\n") == []
