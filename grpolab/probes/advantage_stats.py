"""Zero-sum statistics of group-mean advantages [Foundations, Thm 4.1 and Eq. 20].

For R i.i.d. rewards with variance sigma^2 and A_i = r_i - mean(r):
(i) sum_i A_i = 0; (ii) Var(A_i) = (R-1)/R sigma^2; (iii) Cov(A_i, A_j) = -sigma^2/R;
(iv) P(|A_i| > eps) <= (R-1) sigma^2 / (R eps^2) (Chebyshev, Eq. 20).

A note on checking (ii)-(iii) on a training batch: with sigma^2 estimated by each
group's unbiased sample variance s^2, the pooled empirical E[A_i^2] equals
(R-1)/R * mean(s^2) *exactly* (sum_i (r_i - mean)^2 = (R-1) s^2), and likewise the
covariance. So on a batch the comparison is an identity that checks the code, not the
theorem; the theorem is tested against a known sigma^2 by ``grpolab theory advantages``
(Bernoulli(p) rewards, sigma^2 = p(1-p)).
"""

from __future__ import annotations

import torch

from grpolab.algo.advantages import compute_advantages


def advantage_stats(
    rewards: torch.Tensor | list[torch.Tensor], eps: float = 0.2, sigma2: float | None = None
) -> dict[str, float]:
    """Statistics of ``grpo`` advantages for group rewards ``[B, R]`` (or a list of groups, see below).

    ``sigma2``: the true reward variance if known (one prompt, Bernoulli(p) rewards);
    otherwise each group's unbiased sample variance, averaged over groups.

    Keys: ``max_abs_group_sum``, ``var_emp``, ``var_theory``, ``cov_emp``,
    ``cov_theory``, ``eff_frac_emp`` (share of |A_i| > eps), ``eff_bound``
    (Eq. 20, capped at 1), ``frac_zero_var`` (groups whose rewards are all equal),
    ``sigma2``.

    A list of groups ``[R_b]`` of different sizes (``--sampling adaptive``) gives the same
    statistics pooled over rollouts: each group's theory at its own R_b, weighted by its
    rollouts (its pairs, for the covariance). Equal sizes give exactly the ``[B, R]`` result.
    """
    if isinstance(rewards, (list, tuple)):
        if len({len(r) for r in rewards}) == 1:
            rewards = torch.stack(list(rewards))
        else:
            return _ragged_stats([r.double() for r in rewards], eps, sigma2)
    rewards = rewards.double()
    B, R = rewards.shape
    if R < 2:
        raise ValueError(f"advantage statistics need R >= 2 rollouts per group, got {R}")
    A = compute_advantages(rewards, "grpo").double()  # [B, R]
    group_sum = A.sum(dim=1)  # [B]
    var_emp = A.pow(2).mean()  # E[A] = 0 exactly, so the second moment is the variance
    cross = group_sum.pow(2) - A.pow(2).sum(dim=1)  # sum_{i != j} A_i A_j per group, [B]
    cov_emp = cross.sum() / (B * R * (R - 1))
    if sigma2 is None:
        sigma2_t = rewards.var(dim=1, unbiased=True).mean()
    else:
        sigma2_t = torch.tensor(float(sigma2), dtype=torch.float64)
    return {
        "max_abs_group_sum": float(group_sum.abs().max()),
        "var_emp": float(var_emp),
        "var_theory": float((R - 1) / R * sigma2_t),
        "cov_emp": float(cov_emp),
        "cov_theory": float(-sigma2_t / R),
        "eff_frac_emp": float((A.abs() > eps).double().mean()),
        "eff_bound": float(min(1.0, (R - 1) * sigma2_t / (R * eps**2))),
        "frac_zero_var": float((rewards == rewards[:, :1]).all(dim=1).double().mean()),
        "sigma2": float(sigma2_t),
    }


def _ragged_stats(groups: list[torch.Tensor], eps: float, sigma2: float | None) -> dict[str, float]:
    if min(len(r) for r in groups) < 2:
        raise ValueError("advantage statistics need R >= 2 rollouts per group")
    A = [compute_advantages(r[None, :], "grpo")[0].double() for r in groups]
    R = torch.tensor([len(r) for r in groups], dtype=torch.float64)  # [B]
    s2 = (
        torch.stack([r.var(unbiased=True) for r in groups])
        if sigma2 is None
        else torch.full((len(groups),), float(sigma2), dtype=torch.float64)
    )  # [B]
    N, pairs = R.sum(), (R * (R - 1)).sum()
    sums = torch.stack([a.sum() for a in A])  # [B]
    sq = torch.stack([a.pow(2).sum() for a in A])  # [B]
    var_theory = ((R - 1) * s2).sum() / N
    return {
        "max_abs_group_sum": float(sums.abs().max()),
        "var_emp": float(sq.sum() / N),
        "var_theory": float(var_theory),
        "cov_emp": float((sums.pow(2) - sq).sum() / pairs),
        "cov_theory": float(-((R - 1) * s2).sum() / pairs),
        "eff_frac_emp": float(sum(int((a.abs() > eps).sum()) for a in A) / N),
        "eff_bound": float(min(1.0, var_theory / eps**2)),
        "frac_zero_var": sum(bool((r == r[0]).all()) for r in groups) / len(groups),
        "sigma2": float(s2.mean()),
    }
