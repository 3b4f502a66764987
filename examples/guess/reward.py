"""The guessing game's held-out accuracy (``--eval-reward-fn examples/guess/reward.py:found``), in TRL's form: 1
when the game ended with the number found. ``completions[i]`` is the list of messages after the opening, the
environment's last word ("Correct!") included."""

from __future__ import annotations


def found(prompts, completions, **kwargs) -> list[float]:
    return [float(bool(c) and c[-1]["role"] == "user" and c[-1]["content"] == "Correct!") for c in completions]
