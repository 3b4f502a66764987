"""Has GRPO run out of signal? The online signals of a run, read [Foundations, Sec. 8].

A run trained with ``--probe-every`` logs, besides its held-out accuracy: the effective rank of each measured group's
per-rollout gradient matrix (``probe/eff_rank``, and at half the group size ``probe/eff_rank_half``), the mean spread
of the rewards within a group (``reward/group_std_mean``, sigma_r) and the share of groups whose rewards are all
equal (``reward/frac_zero_std``: they carry no gradient), and the group size that would minimise the gradient's
error at the step's rollout budget, estimated on the probe's groups (``probe/g_star``) [U-statistic, Thm 7]. This
module finds a run's saturation step by a fixed rule and says in one line what each signal shows; the report's signal
panel and ``benchmarks/signals.py`` use it.
"""

from __future__ import annotations

SIGNALS = {
    "probe/eff_rank": "effective rank",
    "reward/group_std_mean": "reward spread in a group (sigma_r)",
    "reward/frac_zero_std": "groups with equal rewards",
    "probe/g_star": "best group size at the budget (G*)",
}
"""The signals the panel draws, by metric key."""


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of the steps that logged ``key``."""
    return [(r["step"], r[key]) for r in rows if r.get(key) is not None]


def saturation_step(evals: list[tuple[int, float]], share: float = 0.9) -> int | None:
    """The first evaluation step whose accuracy reaches acc_0 + share (acc_max - acc_0), acc_max the largest of the
    run (the rule fixed before the runs of docs/foundations.md were looked at). None without a gain."""
    if len(evals) < 2:
        return None
    acc0, accmax = evals[0][1], max(a for _, a in evals)
    if accmax <= acc0:
        return None
    return next(s for s, a in evals if a >= acc0 + share * (accmax - acc0))


def onset(points: list[tuple[int, float]], falling: bool) -> int | None:
    """The first step at which a signal has moved half of the way from its first value to its extreme over the
    run (its minimum if ``falling``, else its maximum). None if it never moves."""
    if len(points) < 2:
        return None
    first = points[0][1]
    extreme = min(v for _, v in points) if falling else max(v for _, v in points)
    if extreme == first:
        return None
    half = first + 0.5 * (extreme - first)
    return next(s for s, v in points if (v <= half if falling else v >= half))


def since(points: list[tuple[int, float]], below: float) -> int | None:
    """The step from which every later value stays under ``below`` (None if the last one does not)."""
    start = None
    for s, v in points:
        if v < below:
            start = s if start is None else start
        else:
            start = None
    return start


def readings(rows: list[dict]) -> list[str]:
    """One plain line per signal the run logged, and its saturation step if it has one."""
    out = []
    rank = series(rows, "probe/eff_rank")
    if rank:
        first, last = rank[0], rank[-1]
        line = f"effective rank {last[1]:.2f} at step {last[0]} ({first[1]:.2f} at step {first[0]})"
        low = since(rank, 2.0)
        if low is not None:
            line += f"; below 2 since step {low}: each group's update moves along fewer than two directions"
        half = series(rows, "probe/eff_rank_half")
        if half:
            line += f"; at half the group size {half[-1][1]:.2f}"
        out.append(line)
    sigma = series(rows, "reward/group_std_mean")
    if sigma:
        (s0, v0), (s1, v1) = sigma[0], sigma[-1]
        out.append(
            f"reward spread in a group sigma_r {v0:.3f} at step {s0}, {v1:.3f} at step {s1}: the gradient's size "
            "scales with it [Foundations, Cor. 4.2]"
        )
    zero = series(rows, "reward/frac_zero_std")
    if zero:
        v = zero[-1][1]
        out.append(
            f"{100 * v:.0f}% of the groups at step {zero[-1][0]} had equal rewards (no gradient from them)"
            + ("; most groups are spent: larger groups, or harder prompts, would find a contrast" if v >= 0.5 else "")
        )
    g_star = series(rows, "probe/g_star")
    if g_star:
        (s0, v0), (s1, v1) = g_star[0], g_star[-1]
        group = next((r["control/group_size"] for r in reversed(rows) if r.get("control/group_size")), None)
        out.append(
            f"G* {v1:.1f} at step {s1} ({v0:.1f} at step {s0}): groups of about that size would give the least "
            "gradient error for the rollouts a step draws [U-statistic, Thm 7]"
            + (f"; the run's group size is {group}" if group is not None else "")
        )
    sat = saturation_step(series(rows, "eval/accuracy_greedy"))
    if sat is not None:
        out.append(f"saturation at step {sat}: greedy held-out accuracy reached 90% of its gain over the run")
    return out
