"""Unit tests of grpolab.algo.advantages.compute_advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from grpolab.algo.advantages import STD_EPS, compute_advantages

# Two prompts, four rollouts each.
#   row 0: [1, 0, 0, 1]  mean 0.5, centred [0.5, -0.5, -0.5, 0.5],
#          population var = 4 * 0.25 / 4 = 0.25, std = 0.5
#   row 1: [2, 4, 6, 8]  mean 5,   centred [-3, -1, 1, 3],
#          population var = (9 + 1 + 1 + 9) / 4 = 5, std = sqrt(5)
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]])
CENTRED = [[0.5, -0.5, -0.5, 0.5], [-3.0, -1.0, 1.0, 3.0]]


def test_vanilla_is_the_reward():
    torch.testing.assert_close(compute_advantages(REWARDS, "vanilla"), REWARDS, rtol=0, atol=0)


def test_grpo_hand_computed():
    torch.testing.assert_close(compute_advantages(REWARDS, "grpo"), torch.tensor(CENTRED), rtol=0, atol=1e-7)


def test_grpo_std_hand_computed_population_std_plus_eps():
    # row 0: +-0.5 / (0.5 + 1e-4); row 1: [-3, -1, 1, 3] / (sqrt(5) + 1e-4)
    s0, s1 = 0.5 + 1e-4, math.sqrt(5.0) + 1e-4
    expected = torch.tensor([[0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0], [-3 / s1, -1 / s1, 1 / s1, 3 / s1]])
    torch.testing.assert_close(compute_advantages(REWARDS, "grpo_std"), expected, rtol=1e-6, atol=1e-7)
    assert STD_EPS == 1e-4


def test_grpo_std_is_not_the_sample_std():
    # The sample std (divide by G-1) of row 1 is sqrt(20/3) = 2.582, the population one sqrt(5) = 2.236:
    # the last advantage must be 3/2.236 = 1.3416, not 3/2.582 = 1.1619.
    a = compute_advantages(REWARDS, "grpo_std")
    assert a[1, 3].item() == pytest.approx(3 / (math.sqrt(5) + 1e-4), rel=1e-6)
    assert abs(a[1, 3].item() - 3 / (math.sqrt(20 / 3) + 1e-4)) > 0.1


def test_rloo_hand_computed():
    # row 0: 1 - (0+0+1)/3 = 2/3, 0 - (1+0+1)/3 = -2/3, ...
    # row 1: 2 - (4+6+8)/3 = -4, 4 - (2+6+8)/3 = -4/3, 6 - (2+4+8)/3 = 4/3, 8 - (2+4+6)/3 = 4
    expected = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [-4.0, -4 / 3, 4 / 3, 4.0]])
    torch.testing.assert_close(compute_advantages(REWARDS, "rloo"), expected, rtol=1e-6, atol=1e-6)


def test_oracle_hand_computed():
    values = torch.tensor([0.25, 5.0])
    # row 0: r - 0.25; row 1: r - 5
    expected = torch.tensor([[0.75, -0.25, -0.25, 0.75], [-3.0, -1.0, 1.0, 3.0]])
    torch.testing.assert_close(compute_advantages(REWARDS, "oracle", values), expected, rtol=0, atol=1e-7)


def test_grpo_sums_to_zero_in_each_group_on_random_rewards():
    # [Foundations, Thm 4.1(i)].
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(64, 8, generator=g) * 10 - 3  # [B, G]
    a = compute_advantages(rewards, "grpo")
    assert a.shape == (64, 8)
    assert a.sum(dim=1).abs().max().item() < 1e-5
    # and it is not trivially zero
    assert a.abs().max().item() > 1.0


def test_rloo_is_g_over_g_minus_1_times_grpo_and_the_literal_leave_one_out():
    g = torch.Generator().manual_seed(1)
    for G in (2, 3, 5, 8):
        rewards = torch.randn(6, G, generator=g, dtype=torch.float64).float()
        rloo = compute_advantages(rewards, "rloo")
        torch.testing.assert_close(rloo, G / (G - 1) * compute_advantages(rewards, "grpo"), rtol=1e-5, atol=1e-6)
        # literal definition: r_i minus the mean of the other G-1 rewards
        r = rewards.double().tolist()
        literal = [[row[i] - sum(row[j] for j in range(G) if j != i) / (G - 1) for i in range(G)] for row in r]
        torch.testing.assert_close(rloo.double(), torch.tensor(literal, dtype=torch.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "grpo_std", "rloo"])
@pytest.mark.parametrize("G", [4, 8])
@pytest.mark.parametrize("value", [0.0, 0.1, 1.0, 1.1])
def test_all_equal_group_gives_exactly_zero_not_nan(estimator, G, value):
    # The rewards r = accuracy + 0.1 * format take the values 0, 0.1, 1, 1.1; a group in which
    # every rollout earns the same one has r - mean = 0, so every advantage must be exactly 0
    # (the docstring's promise; the trainer skips rollouts with advantage exactly 0 and counts
    # such groups in reward/frac_zero_std).
    rewards = torch.full((3, G), value)
    rewards[1] = torch.linspace(0, 1, G)  # a non-constant group in the same batch
    a = compute_advantages(rewards, estimator)
    assert not torch.isnan(a).any()
    assert torch.equal(a[0], torch.zeros(G)), a[0].tolist()
    assert torch.equal(a[2], torch.zeros(G)), a[2].tolist()
    assert a[1].abs().max() > 0


def test_output_shape_and_float_dtype_for_integer_rewards():
    rewards = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 1]])
    a = compute_advantages(rewards, "grpo")
    assert a.dtype == torch.float32 and a.shape == (2, 4)
    # row 1: mean 0.25 -> [-0.25, -0.25, -0.25, 0.75]
    torch.testing.assert_close(a[1], torch.tensor([-0.25, -0.25, -0.25, 0.75]))


def test_vanilla_allows_a_single_rollout_per_prompt():
    torch.testing.assert_close(
        compute_advantages(torch.tensor([[0.3], [1.0]]), "vanilla"), torch.tensor([[0.3], [1.0]])
    )


# ---------------------------------------------------------------- errors


def test_unknown_estimator_raises():
    with pytest.raises(ValueError, match="unknown estimator"):
        compute_advantages(REWARDS, "ppo")


@pytest.mark.parametrize("estimator", ["grpo", "grpo_std", "rloo"])
def test_group_estimators_need_two_rollouts(estimator):
    with pytest.raises(ValueError, match="G=1"):
        compute_advantages(torch.ones(3, 1), estimator)


def test_oracle_without_values_raises():
    with pytest.raises(ValueError, match="oracle"):
        compute_advantages(REWARDS, "oracle")


@pytest.mark.parametrize("shape", [(3,), (2, 1), (1,), (2, 4)])
def test_oracle_with_wrong_value_shape_raises(shape):
    with pytest.raises(ValueError, match="oracle"):
        compute_advantages(REWARDS, "oracle", torch.zeros(shape))


@pytest.mark.parametrize("shape", [(4,), (2, 2, 2), ()])
def test_non_2d_rewards_raise(shape):
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        compute_advantages(torch.zeros(shape), "grpo")


def test_sample_std_divides_by_g_minus_1_as_torch_std():
    """--reward-std sample (TRL's convention): (r - mean) / (torch.std(r) + 1e-4), per group and over the batch."""
    from grpolab.algo.advantages import batch_std

    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.9, 0.4, 0.4]])
    want = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)
    assert torch.allclose(compute_advantages(r, "grpo_std", sample_std=True), want, atol=1e-6)
    population = compute_advantages(r, "grpo_std")
    assert not torch.allclose(population, want, atol=1e-3)
    assert float(batch_std(r, sample=True)) == pytest.approx(float(r.std()), rel=1e-6)
    assert float(batch_std(r)) == pytest.approx(float(r.std(unbiased=False)), rel=1e-6)
