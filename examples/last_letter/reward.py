"""The last-letter reward, in TRL's form: the same function works in grpolab and in TRL's GRPOTrainer.

``completions`` are chat messages for a chat model (strings otherwise); ``target`` is the task's column of
the same name, one value per completion. Only the standard library is used.
"""

import re

_SINGLE_LETTER = re.compile(r"(?<![A-Za-z])([A-Za-z])(?![A-Za-z])")


def last_letter(prompts, completions, target, **kwargs):
    """1.0 when the reply's last standalone letter (a letter with no letter beside it: "u", "'u'.", "is U") is the
    word's last letter, case ignored; else 0.0."""
    rewards = []
    for completion, want in zip(completions, target):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        letters = _SINGLE_LETTER.findall(text)
        rewards.append(1.0 if letters and letters[-1].lower() == want else 0.0)
    return rewards
