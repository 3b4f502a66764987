"""The ``chain`` environment: GRPO's multi-turn bias, exactly [Foundations, Sec. 6 and App. A.3].

H stages. The state s_h at stage h is whether stage h-1 succeeded (stage 1 starts as if
it had). The policy succeeds with probability q1 after a success and q0 after a failure;
each success pays reward 1. Dynamic programming gives everything exactly:

    v_h(s)     = q_s (1 + v_{h+1}(1)) + (1 - q_s) v_{h+1}(0),  v_{H+1} = 0   (reward-to-go value)
    q_h(s, a)  = 1 + v_{h+1}(1) if a succeeds, else v_{h+1}(0)
    A_h(s, a)  = q_h(s, a) - v_h(s)

and a history up to stage h matters only through (past reward k, state s_h).

Three advantage estimators of stage h's action, and their history-conditional bias
E[hat A | history] - A in the infinite-group limit (the group baseline -> v_1(1)):

    grpo       total return - group baseline        k + v_h(s) - v_1(1)   (Eq. 23: leakage k + mismatch)
    rtg-group  reward-to-go - group baseline            v_h(s) - v_1(1)   (leakage removed)
    rtg-mc     reward-to-go - MC value of s_h                           0   (both removed)

Averaged over histories grpo's bias is 0 (E k + E v_h = v_1); what grows with h is its
spread over histories, reported as a root mean square.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from grpolab.common.stats import percentile_interval

STAGE_ADVANTAGES = ("grpo", "rtg-group", "rtg-mc")


@dataclasses.dataclass(frozen=True)
class Chain:
    H: int = 4
    q1: float = 0.8
    q0: float = 0.3

    def __post_init__(self):
        if self.H < 1:
            raise ValueError(f"--stages must be >= 1, got {self.H}")
        if not (0 <= self.q0 <= 1 and 0 <= self.q1 <= 1):
            raise ValueError(f"--q0 and --q1 must lie in [0, 1], got {self.q0}, {self.q1}")

    def q(self, s: int) -> float:
        return self.q1 if s else self.q0

    def values(self) -> list[list[float]]:
        """v[h][s] for h = 1 .. H+1 (index 0 unused)."""
        v = [[0.0, 0.0] for _ in range(self.H + 2)]
        for h in range(self.H, 0, -1):
            for s in (0, 1):
                v[h][s] = self.q(s) * (1 + v[h + 1][1]) + (1 - self.q(s)) * v[h + 1][0]
        return v

    def histories(self) -> list[dict[tuple[int, int], float]]:
        """P(past reward k, state s) at each stage h = 1 .. H (index 0 unused)."""
        dist = [dict() for _ in range(self.H + 1)]
        dist[1] = {(0, 1): 1.0}
        for h in range(1, self.H):
            for (k, s), p in dist[h].items():
                for (k2, s2), pt in (((k + 1, 1), self.q(s)), ((k, 0), 1 - self.q(s))):
                    if pt > 0:
                        dist[h + 1][(k2, s2)] = dist[h + 1].get((k2, s2), 0.0) + p * pt
        return dist


def conditional_bias(chain: Chain, v: list[list[float]], h: int, k: int, s: int, estimator: str) -> tuple[float, float]:
    """(leakage, mismatch) of ``estimator``'s infinite-group bias at stage h, history (k, s)."""
    mismatch = v[h][s] - v[1][1]
    if estimator == "grpo":
        return float(k), mismatch
    if estimator == "rtg-group":
        return 0.0, mismatch
    if estimator == "rtg-mc":
        return 0.0, 0.0
    raise ValueError(f"unknown estimator {estimator!r}; choose from {STAGE_ADVANTAGES}")


def exact_bias(chain: Chain) -> list[dict]:
    """Per stage and estimator: bias mean and RMS over histories, and the RMS of each part."""
    v, dist = chain.values(), chain.histories()
    rows = []
    for h in range(1, chain.H + 1):
        for est in STAGE_ADVANTAGES:
            mean = rms2 = leak2 = mis2 = 0.0
            for (k, s), p in dist[h].items():
                leak, mis = conditional_bias(chain, v, h, k, s, est)
                mean += p * (leak + mis)
                rms2 += p * (leak + mis) ** 2
                leak2 += p * leak**2
                mis2 += p * mis**2
            rows.append(
                {
                    "stage": h,
                    "estimator": est,
                    "bias_mean": mean,
                    "bias_rms": math.sqrt(rms2),
                    "leakage_rms": math.sqrt(leak2),
                    "mismatch_rms": math.sqrt(mis2),
                }
            )
    return rows


def simulate(
    chain: Chain, n: int, gen: torch.Generator, start: torch.Tensor | None = None, h0: int = 1
) -> torch.Tensor:
    """Successes ``[n, H - h0 + 1]`` of n trajectories from stage h0 in states ``start`` (default: success)."""
    s = torch.ones(n, dtype=torch.bool) if start is None else start.clone()
    out = []
    for _ in range(h0, chain.H + 1):
        p = torch.where(s, chain.q1, chain.q0).double()
        s = torch.bernoulli(p, generator=gen).bool()
        out.append(s)
    return torch.stack(out, dim=1) if out else torch.zeros(n, 0, dtype=torch.bool)


def monte_carlo_bias(
    chain: Chain, R: int, groups: int = 50_000, *, branches: int = 8, seed: int = 0, boot: int = 400
) -> list[dict]:
    """The same quantities from sampled groups of R trajectories, with 95% bootstrap CIs.

    For each trajectory i and stage h the error e = hat A - A(s_h, a_h) uses the true
    advantage (DP). GRPO's group baseline is the mean total return of the *other* R - 1
    trajectories: independent of i, it has the infinite-group baseline's expectation, so
    E[e | history] is Eq. 23's bias exactly. ``rtg-mc``'s baseline is the mean reward-to-go
    of ``branches`` fresh continuations from s_h. The bias of a history class (k, s) is the
    class mean of e; its square is corrected by var / n for the noise in that mean before the
    mean over classes, so the RMS is not inflated by sampling noise. CIs: Poisson bootstrap
    over groups.
    """
    if R < 2:
        raise ValueError(f"--group-size must be >= 2, got {R}")
    gen = torch.Generator().manual_seed(seed)
    v = chain.values()
    traj = _sample_groups(chain, R, groups, gen, v)
    weights = torch.poisson(torch.ones(boot, groups, dtype=torch.float64), generator=gen)  # [boot, g] bootstrap
    rows = []
    for h in range(1, chain.H + 1):
        hi = h - 1
        s_h = traj.state[:, :, hi]
        v_mc = _mc_value(chain, s_h, h, branches, gen)  # [g, R]
        rtg_h = traj.rtg[:, :, hi]
        hats = {"grpo": traj.total - traj.base, "rtg-group": rtg_h - traj.base, "rtg-mc": rtg_h - v_mc}
        k = traj.past[:, :, hi].long()
        onehot = torch.nn.functional.one_hot(k * 2 + s_h.long(), 2 * chain.H + 2).double()  # [g, R, C] class (k, s)
        for est in STAGE_ADVANTAGES:
            e = hats[est] - traj.A[:, :, hi]  # [g, R]
            leak, mis = _parts(chain, v, h, k, s_h, est)
            row = {"stage": h, "estimator": est, **_bias_stats(e, onehot, weights)}
            rows.append({**row, "leakage_rms": leak, "mismatch_rms": mis})
    return rows


class _Groups(NamedTuple):
    """Sampled groups of trajectories and what the stage estimators are built from."""

    total: torch.Tensor  # [g, R] total return
    base: torch.Tensor  # [g, R] leave-one-out group baseline
    rtg: torch.Tensor  # [g, R, H] reward-to-go from stage h
    past: torch.Tensor  # [g, R, H] rewards before stage h
    state: torch.Tensor  # [g, R, H] bool: s_h
    A: torch.Tensor  # [g, R, H] true advantage of the action taken (DP)


def _sample_groups(chain: Chain, R: int, groups: int, gen: torch.Generator, v: list[list[float]]) -> _Groups:
    """``groups`` groups of R trajectories from stage 1, and their per-stage returns, states, advantages."""
    H = chain.H
    x = simulate(chain, groups * R, gen).view(groups, R, H)  # [g, R, H] successes
    r = x.double()
    total = r.sum(dim=2)  # [g, R]
    base = (total.sum(dim=1, keepdim=True) - total) / (R - 1)  # leave-one-out group baseline
    rtg = r.flip(2).cumsum(2).flip(2)  # [g, R, H] reward-to-go from stage h
    past = r.cumsum(2) - r  # rewards before stage h
    state = torch.cat([torch.ones(groups, R, 1, dtype=torch.bool), x[:, :, :-1]], dim=2)  # s_h
    vt = torch.tensor(v, dtype=torch.float64)  # [H+2, 2]
    hs = torch.arange(1, H + 1)
    v_h = vt[hs, state.long()]  # [g, R, H]
    q_h = torch.where(x, 1 + vt[hs + 1, 1], vt[hs + 1, 0])
    return _Groups(total, base, rtg, past, state, q_h - v_h)


def _mc_value(chain: Chain, s_h: torch.Tensor, h: int, branches: int, gen: torch.Generator) -> torch.Tensor:
    """MC value ``[g, R]`` of the states s_h ``[g, R]``: the mean reward-to-go of ``branches`` fresh
    continuations from stage h (the trajectory's own future is not used)."""
    groups, R = s_h.shape
    cont = simulate(chain, groups * R * branches, gen, start=s_h.reshape(-1).repeat_interleave(branches), h0=h)
    return cont.double().sum(1).view(groups, R, branches).mean(2)


def _bias_stats(e: torch.Tensor, onehot: torch.Tensor, weights: torch.Tensor) -> dict[str, float]:
    """Bias mean, RMS over history classes and its bootstrap CI from the errors e ``[g, R]``,
    the history classes ``onehot`` ``[g, R, C]`` and the Poisson weights ``[boot, g]``."""
    groups, C = onehot.shape[0], onehot.shape[2]
    n_c = onehot.sum(1)  # [g, C] per-group class counts
    s1 = (onehot * e[..., None]).sum(1)  # [g, C] per-group class sums
    parts = torch.stack([n_c, s1, s1 * s1, s1 * n_c, n_c * n_c])  # [5, g, C]
    stats = _class_rms(parts.sum(1), groups)
    wsum = (weights @ parts.permute(1, 0, 2).reshape(groups, -1)).view(weights.shape[0], 5, C)  # [boot, 5, C]
    boots = [_class_rms(t, groups) for t in wsum]
    ci_low, ci_high = percentile_interval(b[1] for b in boots)
    return {"bias_mean": float(e.mean()), "bias_rms": stats[1], "ci_low": ci_low, "ci_high": ci_high}


def _class_rms(t: torch.Tensor, groups: int) -> tuple[float, float]:
    """(mean, RMS of the class means) from per-class totals of n, s1, s1^2, s1 n, n^2 over groups.

    The noise in a class mean is estimated with groups as clusters (rollouts of one group
    share their baseline, so their errors are correlated and var/n would understate it):
    Var(mean_c) ~ sum_g (s1_gc - mean_c n_gc)^2 / n_c^2 * G / (G - 1).
    """
    n, s1, s1s1, s1n, nn = t
    keep = n > 1
    n, s1, s1s1, s1n, nn = n[keep], s1[keep], s1s1[keep], s1n[keep], nn[keep]
    mean_c = s1 / n
    var_mean = (s1s1 - 2 * mean_c * s1n + mean_c**2 * nn) / n**2 * groups / (groups - 1)
    sq = mean_c**2 - var_mean  # unbiased for the squared class bias, to first order
    p = n / n.sum()
    return float((p * mean_c).sum()), math.sqrt(max(float((p * sq).sum()), 0.0))


def _parts(chain: Chain, v, h: int, k: torch.Tensor, s: torch.Tensor, est: str) -> tuple[float, float]:
    """RMS over the sampled histories of the two parts of the bias (from the DP values)."""
    vt = torch.tensor(v, dtype=torch.float64)
    leak = k.double() if est == "grpo" else torch.zeros(k.shape, dtype=torch.float64)
    mis = vt[h, s.long()] - vt[1, 1] if est != "rtg-mc" else torch.zeros(k.shape, dtype=torch.float64)
    return math.sqrt(float((leak**2).mean())), math.sqrt(float((mis**2).mean()))
