"""The calculator task's reward, in TRL's form: 1 when the final reply's last number is the product, else 0.

For a chat run ``completions[i]`` is the list of messages the episode added after the prompt (replies and tool
results); the final reply is the last of them.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*")


def final_text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def correct(prompts, completions, answer, **kwargs) -> list[float]:
    out = []
    for completion, truth in zip(completions, answer):
        numbers = _NUMBER.findall(final_text(completion))
        out.append(float(bool(numbers) and numbers[-1].replace(",", "") == truth))
    return out
