"""The softmax bandit: a policy over K arms with Bernoulli rewards, where every quantity of the U-statistic view is
exact (:func:`bandit_moments`), so the closed-form MSEs of :mod:`grpolab.probes.mse` can be checked against Monte
Carlo draws of the estimators themselves (:func:`bandit_mse_mc`) [U-statistic, Sec. 4.1]."""

from __future__ import annotations

import torch

from grpolab.common.stats import mean_ci
from grpolab.probes.mse import MSE_ESTIMATORS


def bandit_moments(arm_probs: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    """Exact A2, O2, H2, mu2 for a softmax policy over K arms with Bernoulli(p_k) rewards.

    psi(a) = e_a - pi, so ||psi(a)||^2 = 1 - 2 pi_a + ||pi||^2 and ||psi(a) - psi(a')||^2 = 2 [a != a'].
    """
    p = arm_probs.double()
    pi = torch.softmax(logits.double(), dim=0)
    J = float((pi * p).sum())
    mu = pi * (p - J)
    psi_sq = 1 - 2 * pi + (pi * pi).sum()  # [K]
    A2 = (pi * p * psi_sq).sum()
    O2 = (pi * (p * (1 - J) ** 2 + (1 - p) * J**2) * psi_sq).sum()
    differ = p[:, None] * (1 - p[None, :]) + p[None, :] * (1 - p[:, None])  # P(r != r' | a, a')
    not_same = 1.0 - torch.eye(p.shape[0], dtype=torch.float64)
    H2 = (pi[:, None] * pi[None, :] * differ * 2 * not_same).sum() / 4
    return {"A2": float(A2), "O2": float(O2), "H2": float(H2), "mu2": float((mu * mu).sum())}


def bandit_true_gradient(arm_probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """grad J = pi * (p - J)."""
    p = arm_probs.double()
    pi = torch.softmax(logits.double(), dim=0)
    return pi * (p - (pi * p).sum())


def bandit_estimates(
    arms: torch.Tensor, rewards: torch.Tensor, pi: torch.Tensor, J: float, estimator: str
) -> torch.Tensor:
    """``[trials, K]`` estimates from ``arms``/``rewards`` ``[trials, G]``: the estimator formed directly, not from moments."""
    K = pi.shape[0]
    G = arms.shape[1]
    psi = torch.nn.functional.one_hot(arms, K).double() - pi  # [trials, G, K]
    r = rewards.double()
    if estimator == "vanilla":
        a = r
    elif estimator == "oracle":
        a = r - J
    elif estimator == "grpo":
        a = r - r.mean(dim=1, keepdim=True)
    elif estimator == "rloo":
        a = r - (r.sum(dim=1, keepdim=True) - r) / (G - 1)
    else:
        raise ValueError(f"unknown estimator {estimator!r}")
    return (a[..., None] * psi).mean(dim=1)


def bandit_mse_mc(
    arm_probs: torch.Tensor, logits: torch.Tensor, G: int, trials: int, seed: int, estimators=MSE_ESTIMATORS
) -> dict[str, tuple[float, float, float]]:
    """Monte Carlo MSE and its 95% CI per estimator, all estimators on the same draws."""
    gen = torch.Generator().manual_seed(seed)
    pi = torch.softmax(logits.double(), dim=0)
    J = float((pi * arm_probs.double()).sum())
    arms = torch.multinomial(pi.expand(trials, -1), G, replacement=True, generator=gen)  # [trials, G]
    rewards = torch.bernoulli(arm_probs.double()[arms], generator=gen)  # [trials, G]
    grad = bandit_true_gradient(arm_probs, logits)
    out = {}
    for est in estimators:
        if est in ("grpo", "rloo") and G < 2:
            continue
        err = ((bandit_estimates(arms, rewards, pi, J, est) - grad) ** 2).sum(dim=1)  # [trials]
        out[est] = mean_ci(err)
    return out


def bandit_pool_gram(arms: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """Psi ``[N, N]`` of a bandit pool: <e_a - pi, e_b - pi> = [a = b] - pi_a - pi_b + ||pi||^2."""
    pid = pi.double()
    pa = pid[arms]
    return (arms[:, None] == arms[None, :]).double() - pa[:, None] - pa[None, :] + (pid * pid).sum()
