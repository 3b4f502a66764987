"""The built-in verifiable rewards [RLVR essay, Sec. 3.4]: r = accuracy + lambda * format, and DAPO's overlong
penalty."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch

from grpolab.data.answers import extract_final_number, math_equal, numbers_equal

# A reward function in grpolab's form (grpolab.rewards.forms adapts TRL's).
RewardFn = Callable[[list[str], list[dict]], Sequence[float]]

# A well-formed final line: '#### <number>' and nothing after it but white space.
_FORMAT = re.compile(r"(?:^|\n)#### ?-?\d[\d,]*(?:\.\d+)?\.?[ \t]*\n?\s*$")


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


def format_reward(completions: list[str], records: list[dict]) -> list[float]:
    """1 if the completion ends with a well-formed ``#### <number>`` line (MATH records: holds a ``\\boxed{}``), else 0."""
    return [
        float("\\boxed{" in c) if r.get("format") == "math" else float(bool(_FORMAT.search(c)))
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
