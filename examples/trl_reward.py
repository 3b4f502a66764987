"""Reward functions written in TRL's convention, used by grpolab as they are.

TRL's GRPOTrainer calls each reward function with keyword arguments: ``prompts``,
``completions`` and every other column of the dataset (here: the fields of a
grpolab record, such as ``ground_truth`` and ``question``), one value per
completion. For chat models completions are message lists
(``[{"role": "assistant", "content": "..."}]``), otherwise strings. grpolab
recognises this form from the signature, so the same file serves both tools:

    grpolab train --reward-fn examples/trl_reward.py:correct \\
                  --reward-fn examples/trl_reward.py:concise --reward-weights 1,0.2

The reward is then ``1 * correct + 0.2 * concise (+ format_weight * format)``, and
each function's mean is logged as ``reward/correct`` and ``reward/concise``.
Only the standard library is used, so the file can be copied anywhere.
"""

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _text(completion) -> str:
    """The completion's text, whether a string or a list of chat messages."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def correct(prompts, completions, ground_truth, **kwargs):
    """1.0 when the last number of the completion equals the ground truth, else 0.0."""
    rewards = []
    for completion, truth in zip(completions, ground_truth):
        numbers = _NUMBER.findall(_text(completion))
        if not numbers:
            rewards.append(0.0)
            continue
        try:
            rewards.append(float(float(numbers[-1].replace(",", "")) == float(str(truth).replace(",", ""))))
        except ValueError:
            rewards.append(0.0)
    return rewards


def concise(completions, **kwargs):
    """1.0 for an empty answer, falling linearly to 0.0 at 200 characters and beyond."""
    return [max(0.0, 1.0 - len(_text(c)) / 200) for c in completions]
