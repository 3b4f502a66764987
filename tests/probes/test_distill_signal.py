"""The distillation signal's estimators (grpolab.probes.distill_signal) on synthetic rollouts with known moments:
each pool estimate is unbiased, so its mean over seeded pools lands on the closed form."""

from __future__ import annotations

import itertools

import pytest
import torch

from grpolab.probes.distill_signal import cosine, mean_estimator_mse, mix_mse, off_mean, reward_cross

D = 6
U = torch.tensor([1.0, -0.5, 0.0, 2.0, 0.3, 0.0], dtype=torch.float64)  # psi's reward direction
W = torch.tensor([0.2, 0.4, -1.0, 0.0, 0.5, 1.0], dtype=torch.float64)  # mu_KL


def _pool(N: int, g: torch.Generator, *batch: int):
    """N rollouts (``batch``: that many pools at once): r ~ Bernoulli(1/2); psi = (r - 1/2) U + noise (mu_R = U / 4);
    e = W + noise; a = e + noise."""
    r = torch.bernoulli(torch.full((*batch, N), 0.5, dtype=torch.float64), generator=g)
    psi = (r - 0.5)[..., None] * U + torch.randn(*batch, N, D, generator=g, dtype=torch.float64)
    e = W + 0.5 * torch.randn(*batch, N, D, generator=g, dtype=torch.float64)
    a = e + torch.randn(*batch, N, D, generator=g, dtype=torch.float64)
    return r, psi, e, a


def test_mean_estimator_mse_is_the_variance_over_G_plus_the_squared_bias():
    g = torch.Generator().manual_seed(0)
    G, runs = 4, []
    for _ in range(200):
        _, _, e, a = _pool(24, g)
        b = a + 0.7  # biased by 0.7 in every coordinate
        runs.append(
            (mean_estimator_mse(a @ a.T, a @ e.T, e @ e.T, G), mean_estimator_mse(b @ b.T, b @ e.T, e @ e.T, G))
        )
    unbiased, biased = (sum(x) / len(runs) for x in zip(*runs))
    var = D * (0.25 + 1.0)  # tr Cov(a): e's noise plus a's own
    assert unbiased == pytest.approx(var / G, rel=0.05)
    assert biased == pytest.approx(var / G + D * 0.49, rel=0.05)


def test_reward_cross_and_the_cosine_are_unbiased_for_the_two_targets():
    g = torch.Generator().manual_seed(1)
    crosses, mu2s = [], []
    for _ in range(100):
        r, psi, e, _ = _pool(30, g)
        crosses.append(reward_cross(r, psi @ e.T))
        mu2s.append(off_mean(e @ e.T))
    assert sum(crosses) / len(crosses) == pytest.approx(float(U @ W) / 4, abs=0.05)
    assert sum(mu2s) / len(mu2s) == pytest.approx(float(W @ W), rel=0.03)
    assert cosine(-1.0, 4.0, 1.0) == -0.5


@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_mix_mse_matches_fresh_groups_drawn_from_the_distribution(lam):
    g = torch.Generator().manual_seed(2)
    G = 4
    target = U / 4 - lam * W
    r, psi, _, a = _pool(G, g, 40000)  # the MSE by definition: fresh groups of G against the true target
    est = ((r - r.mean(-1, keepdim=True))[..., None] * psi - lam * a).sum(-2) / G  # [40000, D]
    fresh = (est - target).pow(2).sum(-1).tolist()
    subsets = torch.tensor(list(itertools.combinations(range(10), G)))
    pools = []
    for _ in range(300):
        r, psi, e, a = _pool(10, g)
        blocks = {"PP": psi @ psi.T, "PA": psi @ a.T, "AA": a @ a.T, "PE": psi @ e.T, "EE": e @ e.T}
        pools.append(mix_mse(blocks, r, lam, subsets)["mse"])
    assert sum(pools) / len(pools) == pytest.approx(sum(fresh) / len(fresh), rel=0.05)
