"""Intervals for the figures grpolab reports: accuracies over questions and means over prompts."""

from __future__ import annotations

import math

import torch

Z95 = 1.959963984540054  # the standard normal's 0.975 quantile


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (successes out of n).

    Unlike the normal (Wald) interval it stays inside [0, 1] and does not collapse to a
    point at 0 or n successes, which is where a weak model's accuracy often is.
    """
    if n <= 0:
        return math.nan, math.nan
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_ci(values: list[float] | torch.Tensor) -> tuple[float, float, float]:
    """Mean and normal 95% interval of the mean (nan bounds for fewer than two values)."""
    v = torch.as_tensor(values, dtype=torch.float64)
    mean = float(v.mean())
    if v.numel() < 2:
        return mean, float("nan"), float("nan")
    half = Z95 * float(v.std(unbiased=True)) / math.sqrt(v.numel())
    return mean, mean - half, mean + half


def clustered_accuracy_interval(per_question: list[float]) -> tuple[float, float]:
    """95% interval of a sampled accuracy from each question's fraction of correct samples.

    The k samples of one question are not independent draws from the task, so the unit is
    the question: a normal interval of the mean of the per-question fractions (a clustered
    standard error), clipped to [0, 1]. With every question at 0 (or 1) it is a point.
    """
    _, lo, hi = mean_ci(per_question)
    return max(0.0, lo), min(1.0, hi)


def percentile_interval(values, level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` interval of bootstrap replicates: the sorted values at
    ``(1 - level) / 2`` and ``(1 + level) / 2`` of the way through (lower index)."""
    v = sorted(values)
    n = len(v) - 1
    return v[int((1 - level) / 2 * n)], v[int((1 + level) / 2 * n)]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct: the chance that k of them,
    drawn without replacement, hold at least one correct, 1 - C(n-c, k) / C(n, k) [Codex, Sec. 2.1] (not "is one of
    the first k right", whose variance is larger). Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which no
    factorial overflows."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def default_pass_k(samples: int) -> tuple[int, ...]:
    """The k of pass@k reported for ``samples`` samples per question: the powers of two up to it, and it."""
    ks = [2**i for i in range(samples.bit_length()) if 2**i <= samples]
    return tuple(ks + ([samples] if samples and ks[-1] != samples else []))


def with_interval(row: dict, key: str) -> str:
    """``0.444 [0.403, 0.485]``: the figure ``row[key]`` with the 95% interval logged beside it (``key_lo``,
    ``key_hi``), where the row has one."""
    lo, hi = row.get(key + "_lo"), row.get(key + "_hi")
    return f"{row[key]:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else "")
