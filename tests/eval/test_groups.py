"""grpolab.eval.groups' loss at ratio 1 (TRL's eval_loss) against hand-computed values."""

from __future__ import annotations

import math

import pytest

from grpolab.config.objective import ObjectiveSection, TermSection
from grpolab.eval.groups import RatioOneLoss, ratio_one_loss
from grpolab.rollout.collect import Generated
from grpolab.training.update import loss_options


def _batch(rewards: list[float], lengths: list[int], truncated: list[bool] | None = None) -> Generated:
    n = len(rewards)
    return Generated(rewards, rewards, None, {}, [], lengths, truncated or [False] * n, 0, {})


def _loss(aggregation: str, **kw) -> RatioOneLoss:
    options = loss_options(ObjectiveSection(aggregation=aggregation), TermSection(), 16)
    return RatioOneLoss(options, "grpo_std", "group", False, **kw)


# two groups of 3: the first's rewards vary, the second's are all equal (no advantage)
REWARDS, LENGTHS = [1.0, 0.0, 0.0, 2.0, 2.0, 2.0], [2, 1, 1, 3, 1, 2]
LOGPROBS = [[-0.5] * n for n in LENGTHS]
ENTROPY = [[0.25 * (i + 1)] * n for i, n in enumerate(LENGTHS)]
STD = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 3)  # the first group's population std
ADV = [(2 / 3) / (STD + 1e-4), -(1 / 3) / (STD + 1e-4), -(1 / 3) / (STD + 1e-4), 0.0, 0.0, 0.0]


def test_the_token_mean_loss_at_ratio_one_is_minus_the_length_weighted_advantage():
    got = ratio_one_loss(_batch(REWARDS, LENGTHS), 3, LOGPROBS, ENTROPY, _loss("token-mean"))
    expected = -sum(a * n for a, n in zip(ADV, LENGTHS)) / sum(LENGTHS)
    assert got["loss/total"] == pytest.approx(expected, rel=1e-5)
    assert got["loss/policy"] == pytest.approx(expected, rel=1e-5)
    clipped = ("loss/clip_frac", "loss/clip_low_frac", "loss/clip_high_frac", "loss/clip_low_min", "loss/clip_high_max")
    assert [got[k] for k in clipped] == [0.0] * 5  # ratio 1: nothing clipped


def test_the_sequence_mean_loss_and_the_entropy_bonus():
    """GRPO's aggregation (each completion's token mean, averaged: -mean A, 0 over whole groups) minus the bonus:
    the coefficient times the token mean of the entropies."""
    got = ratio_one_loss(_batch(REWARDS, LENGTHS), 3, LOGPROBS, ENTROPY, _loss("seq-mean-token-mean", entropy_coef=0.1))
    entropy = sum(h for row in ENTROPY for h in row) / sum(LENGTHS)
    assert got["loss/policy"] == pytest.approx(-sum(ADV) / 6, abs=1e-6)
    assert got["loss/total"] == pytest.approx(-sum(ADV) / 6 - 0.1 * entropy, rel=1e-5)


def test_a_truncated_completion_carries_no_loss_under_mask_truncated():
    truncated = [True, False, False, False, False, False]
    got = ratio_one_loss(
        _batch(REWARDS, LENGTHS, truncated), 3, LOGPROBS, ENTROPY, _loss("token-mean", mask_truncated=True)
    )
    kept = [(a, n) for a, n, t in zip(ADV, LENGTHS, truncated) if not t]
    assert got["loss/total"] == pytest.approx(-sum(a * n for a, n in kept) / sum(n for _, n in kept), rel=1e-5)
