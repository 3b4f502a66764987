"""The built-in verifiable rewards [RLVR essay, Sec. 3.4]: r = accuracy + lambda * format, and DAPO's overlong
penalty."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch

from grpolab.data.answers import extract_final_number, last_boxed, math_equal, numbers_equal

# A reward function in grpolab's form (grpolab.rewards.forms adapts TRL's).
RewardFn = Callable[[list[str], list[dict]], Sequence[float]]

# A well-formed final line: '#### <number>' and nothing after it but white space.
_FORMAT = re.compile(r"(?:^|\n)#### ?-?\d[\d,]*(?:\.\d+)?\.?[ \t]*\n?\s*$")
# What may follow a final \boxed{...}: white space, math delimiters ($, $$, \] and \)), a full stop, bold (**).
_AFTER_BOX = re.compile(r"(?:\s|\$|\\\]|\\\)|\.|\*\*)*")


def accuracy_reward(completions: list[str], records: list[dict]) -> list[float]:
    """1 if the extracted answer equals ``record["ground_truth"]``, else 0.

    MATH-format records (``record["format"] == "math"``) are compared with math-verify.
    """
    out = []
    for c, r in zip(completions, records):
        if r.get("format") == "math":
            out.append(float(math_equal(c, str(r["ground_truth"]))))
        else:
            out.append(float(numbers_equal(extract_final_number(c), str(r["ground_truth"]))))
    return out


accuracy_reward.columns = ("ground_truth",)


def ends_with_boxed(completion: str) -> bool:
    """Whether ``completion`` ends with its answer boxed: its last ``\\boxed{`` closes (braces balanced) around
    something other than white space, and after the closing brace only decoration remains (white space, ``$``,
    ``$$``, ``\\]``, ``\\)``, a full stop, ``**``)."""
    start = completion.rfind("\\boxed{")
    inner = last_boxed(completion) if start >= 0 else None
    if inner is None or not inner.strip():
        return False
    end = start + len("\\boxed{") + len(inner) + 1  # past the closing brace
    return _AFTER_BOX.fullmatch(completion, end) is not None


def format_reward(completions: list[str], records: list[dict]) -> list[float]:
    """1 if the completion ends with a well-formed ``#### <number>`` line, else 0.

    MATH records (``record["format"] == "math"``): 1 if it ends with a final ``\\boxed{...}`` answer
    (:func:`ends_with_boxed`), so a ``\\boxed{`` left open, an empty box or one followed by more text earns nothing.
    """
    return [
        float(ends_with_boxed(c)) if r.get("format") == "math" else float(bool(_FORMAT.search(c)))
        for c, r in zip(completions, records)
    ]


def default_reward_fns(format_weight: float = 0.1, accuracy_fn: RewardFn = accuracy_reward):
    """``r = accuracy + format_weight * format`` [RLVR essay, Sec. 3.4]."""
    return [("accuracy", accuracy_fn, 1.0), ("format", format_reward, format_weight)]


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (docs/references.md), scaled by ``penalty``: ``[N]``.

    0 for a completion of at most ``max_len - buffer`` tokens, then falling linearly to
    ``-penalty`` at ``max_len`` (the generation limit, so never beyond):
    ``min(0, -(length - (max_len - buffer)) / buffer) * penalty``, as verl's ``overlong_buffer``.
    """
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    exceed = lengths.float() - (max_len - buffer)
    return torch.clamp(-exceed / buffer, max=0.0) * penalty
