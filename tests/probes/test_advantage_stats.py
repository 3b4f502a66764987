"""Tests of grpolab.probes.advantage_stats: the Foundations paper's Thm 4.1 and Eq. 20.

Unit: a [2, 4] reward matrix with the advantages and their averages written out by hand.
Statistical: Bernoulli(0.3) rewards, R = 8, 200k seeded groups, against the closed forms
Var(A_i) = (R-1)/R sigma^2 and Cov(A_i, A_j) = -sigma^2/R, and the exact binomial
probability of an epsilon-effective rollout.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpolab.probes.advantage_stats import advantage_stats


def test_hand_computed_two_groups():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # [B=2, R=4]
    # group 1: mean 1/4, A = (3/4, -1/4, -1/4, -1/4), sum A^2 = 9/16 + 3/16 = 3/4
    # group 2: mean 1/2, A = (1/2, 1/2, -1/2, -1/2),   sum A^2 = 4/4 = 1
    # var_emp = (3/4 + 1) / 8 = 7/32
    # sum_{i != j} A_i A_j = (sum A)^2 - sum A^2 = -3/4 and -1; cov_emp = -(7/4) / (2 * 4 * 3) = -7/96
    # (group 1 pair by pair: 6 ordered pairs (1, j) of 3/4 * -1/4 = -9/8, 6 pairs among j of 1/16 = 3/8: -3/4)
    # eps = 0.3: |A| > 0.3 for 3/4 in group 1 and all four 1/2 in group 2: 5/8
    # sigma2 unknown: unbiased group variances 3/4 / 3 = 1/4 and 1 / 3, mean 7/24;
    # var_theory = 3/4 * 7/24 = 7/32, cov_theory = -(7/24) / 4 = -7/96,
    # eff_bound = min(1, 3 * 7/24 / (4 * 0.09)) = min(1, 0.875 / 0.36) = 1
    st = advantage_stats(rewards, eps=0.3)
    assert st["max_abs_group_sum"] == pytest.approx(0.0, abs=1e-7)
    assert st["var_emp"] == pytest.approx(7 / 32, rel=1e-7)
    assert st["cov_emp"] == pytest.approx(-7 / 96, rel=1e-7)
    assert st["eff_frac_emp"] == pytest.approx(5 / 8)
    assert st["frac_zero_var"] == 0.0
    assert st["sigma2"] == pytest.approx(7 / 24, rel=1e-7)
    assert st["var_theory"] == pytest.approx(7 / 32, rel=1e-7)
    assert st["cov_theory"] == pytest.approx(-7 / 96, rel=1e-7)
    assert st["eff_bound"] == 1.0


def test_hand_computed_with_known_sigma2():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    # sigma2 = 0.04: var_theory = 3/4 * 0.04 = 0.03, cov_theory = -0.04 / 4 = -0.01,
    # eff_bound = min(1, 3 * 0.04 / (4 * 0.3^2)) = 0.12 / 0.36 = 1/3; the empirical values do not move
    st = advantage_stats(rewards, eps=0.3, sigma2=0.04)
    assert st["sigma2"] == pytest.approx(0.04)
    assert st["var_theory"] == pytest.approx(0.03)
    assert st["cov_theory"] == pytest.approx(-0.01)
    assert st["eff_bound"] == pytest.approx(1 / 3)
    assert st["var_emp"] == pytest.approx(7 / 32, rel=1e-7)
    assert st["cov_emp"] == pytest.approx(-7 / 96, rel=1e-7)


def test_a_group_of_equal_rewards_counts_in_frac_zero_var():
    # 0.1 is not a binary fraction: the constant group must still give advantages exactly 0
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1], [0.7, 0.7, 0.7, 0.7]])  # [3, 4]
    # A: (3/4, -1/4, -1/4, -1/4) and 8 zeros: var_emp = (3/4) / 12 = 1/16, cov_emp = -(3/4) / (3*4*3) = -1/48
    st = advantage_stats(rewards, eps=0.0)
    assert st["frac_zero_var"] == pytest.approx(2 / 3)
    assert st["eff_frac_emp"] == pytest.approx(4 / 12)  # eps = 0: exactly the 4 non-zero advantages
    assert st["var_emp"] == pytest.approx(1 / 16, rel=1e-7)
    assert st["cov_emp"] == pytest.approx(-1 / 48, rel=1e-7)
    assert st["max_abs_group_sum"] == pytest.approx(0.0, abs=1e-7)


def test_zero_sum_for_arbitrary_rewards():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(50, 6, generator=gen) * 10  # [50, 6]
    st = advantage_stats(rewards)
    assert st["max_abs_group_sum"] < 1e-5
    # the pooled identity of the module docstring: var_emp = (R-1)/R * mean unbiased variance
    assert st["var_emp"] == pytest.approx(st["var_theory"], rel=1e-6)
    assert st["cov_emp"] == pytest.approx(-st["var_emp"] / 5, rel=1e-6)  # sum A = 0: Cov = -Var / (R-1)


def test_groups_of_one_raise():
    with pytest.raises(ValueError, match="R >= 2"):
        advantage_stats(torch.zeros(3, 1))


# ---------------------------------------------------------------- statistical: Thm 4.1 for Bernoulli(0.3)


def _exact_effective_probability(R: int, p: float, eps: float) -> float:
    """P(|A_1| > eps) with A_1 = r_1 - (r_1 + K)/R, K ~ Bin(R-1, p) the other rollouts' successes."""
    total = 0.0
    for r1, p1 in ((0, 1 - p), (1, p)):
        for k in range(R):
            a = r1 - (r1 + k) / R
            if abs(a) > eps:
                total += p1 * math.comb(R - 1, k) * p**k * (1 - p) ** (R - 1 - k)
    return total


@pytest.fixture(scope="module")
def bernoulli_rewards():
    gen = torch.Generator().manual_seed(2024)
    return torch.bernoulli(torch.full((200_000, 8), 0.3, dtype=torch.float64), generator=gen)  # [200k, 8]


def test_theorem_4_1_on_bernoulli_rewards(bernoulli_rewards):
    p, R, sigma2 = 0.3, 8, 0.3 * 0.7  # sigma^2 = 0.21
    st = advantage_stats(bernoulli_rewards, eps=0.5, sigma2=sigma2)
    assert st["var_theory"] == pytest.approx(0.21 * 7 / 8)  # 0.18375
    assert st["cov_theory"] == pytest.approx(-0.21 / 8)  # -0.02625
    assert st["var_emp"] == pytest.approx(0.21 * 7 / 8, rel=0.01)
    assert st["cov_emp"] == pytest.approx(-0.21 / 8, rel=0.03)
    assert st["max_abs_group_sum"] < 1e-5
    # Eq. 20 at eps = 0.5: 7 * 0.21 / (8 * 0.25) = 0.735 < 1, a bound with teeth
    assert st["eff_bound"] == pytest.approx(7 * 0.21 / (8 * 0.25))
    assert st["eff_frac_emp"] <= st["eff_bound"]
    # and the empirical share is the exact binomial probability, within 5 standard errors
    # (the mean over a group's 8 correlated rollouts varies no more than one rollout's indicator)
    exact = _exact_effective_probability(R, p, 0.5)
    se = math.sqrt(exact * (1 - exact) / bernoulli_rewards.shape[0])
    assert abs(st["eff_frac_emp"] - exact) < 5 * se, (st["eff_frac_emp"], exact)
    # P(all 8 equal) = 0.7^8 + 0.3^8 ~ 0.0577
    assert st["frac_zero_var"] == pytest.approx(0.7**8 + 0.3**8, abs=5 * math.sqrt(0.0577 * 0.9423 / 200_000))


def test_eff_bound_is_capped_at_one(bernoulli_rewards):
    # eps = 0.2: 7 * 0.21 / (8 * 0.04) = 4.59, capped at 1
    st = advantage_stats(bernoulli_rewards[:1000], eps=0.2, sigma2=0.21)
    assert st["eff_bound"] == 1.0
    assert st["eff_frac_emp"] <= st["eff_bound"]
