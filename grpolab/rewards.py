"""Verifiable rewards (paper 004, Sec. 3.4): r = accuracy + lambda * format.

A reward function is any callable ``(completions: list[str], records: list[dict])
-> list[float]``; ``records`` carry the ground truth. :func:`score` runs a set
of them so that one that raises, or returns a non-finite value, costs only the
rollouts it failed on (reward 0, counted in ``errors``), never the run.
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Callable, NamedTuple, Sequence

import torch

from grpolab.answers import extract_final_number, math_equal, numbers_equal  # noqa: F401  (re-exported)

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


def format_reward(completions: list[str], records: list[dict]) -> list[float]:
    """1 if the completion ends with a well-formed ``#### <number>`` line (MATH records: holds a ``\\boxed{}``), else 0."""
    return [float("\\boxed{" in c) if r.get("format") == "math" else float(bool(_FORMAT.search(c)))
            for c, r in zip(completions, records)]


def load_reward_fn(path: str) -> RewardFn:
    """Import ``"package.module:function"``; a clear error when it is not there."""
    from grpolab.config import ConfigError  # a ValueError: the CLI prints it as one line, not a traceback

    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--reward-fn: must be given as 'module:function', got {path!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--reward-fn: cannot load {path!r}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"--reward-fn: {path!r} is not callable")
    return fn


class Scores(NamedTuple):
    total: torch.Tensor
    """``[N]`` weighted sum of the components."""
    components: dict[str, torch.Tensor]
    """name -> ``[N]`` unweighted values (0 where the function failed)."""
    errors: int
    """Number of (rollout, function) evaluations that raised or were non-finite."""


def _call_safely(fn: RewardFn, completions: list[str], records: list[dict]) -> tuple[list[float], int]:
    """Values of ``fn``, with failures replaced by 0 and counted.

    The whole batch is tried first (cheap); if it raises or has the wrong length,
    each rollout is scored alone so only the failing ones lose their reward.
    """
    n = len(completions)
    try:
        values = [float(v) for v in fn(completions, records)]
        if len(values) != n:
            raise ValueError(f"returned {len(values)} values for {n} completions")
    except Exception:
        values = []
        for c, r in zip(completions, records):
            try:
                (v,) = fn([c], [r])
                values.append(float(v))
            except Exception:
                values.append(math.nan)
    errors = sum(1 for v in values if not math.isfinite(v))
    return [v if math.isfinite(v) else 0.0 for v in values], errors


def score(
    completions: list[str], records: list[dict], reward_fns: Sequence[tuple[str, RewardFn, float]]
) -> Scores:
    """Score ``N`` completions with weighted reward functions ``(name, fn, weight)``."""
    total = torch.zeros(len(completions))
    components: dict[str, torch.Tensor] = {}
    errors = 0
    for name, fn, weight in reward_fns:
        values, err = _call_safely(fn, completions, records)
        components[name] = torch.tensor(values, dtype=torch.float32)
        total += weight * components[name]
        errors += err
    return Scores(total, components, errors)


def default_reward_fns(format_weight: float = 0.1, accuracy_fn: RewardFn = accuracy_reward):
    """``r = accuracy + format_weight * format`` (paper 004, Sec. 3.4)."""
    return [("accuracy", accuracy_fn, 1.0), ("format", format_reward, format_weight)]
