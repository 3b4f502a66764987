"""The distillation math (grpolab.algo.distill) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from grpolab.algo.distill import (
    correlation,
    divergence_beta,
    k1,
    k3,
    moment_sums,
    teacher_advantage,
    token_divergence,
)


def test_teacher_advantage_is_the_clipped_log_ratio_times_the_coefficient_on_loss_tokens():
    teacher = torch.tensor([[-1.0, -2.0, -30.0], [-0.5, -0.1, -4.0]])
    sampler = torch.tensor([[-1.5, -1.0, -0.2], [-0.5, -3.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    out = teacher_advantage(teacher, sampler, mask, coef=0.5, clip=2.0)
    # by hand: 0.5 * clip(t - s, -2, 2) * mask
    expected = torch.tensor([[0.5 * 0.5, 0.5 * -1.0, 0.5 * -2.0], [0.0, 0.5 * 2.0, 0.0]])
    assert torch.allclose(out, expected)
    assert not out.requires_grad


def _explicit(p_s: list[float], p_t: list[float], beta: float) -> float:
    """The generalized JSD of two distributions over 3 tokens, summed term by term."""
    m = [(1 - beta) * a + beta * b for a, b in zip(p_s, p_t)]
    kl_t = sum(b * math.log(b / c) for b, c in zip(p_t, m))
    kl_s = sum(a * math.log(a / c) for a, c in zip(p_s, m))
    return beta * kl_t + (1 - beta) * kl_s


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_token_divergence_is_the_generalized_jsd(beta):
    p_s, p_t = [0.7, 0.2, 0.1], [0.2, 0.5, 0.3]
    s_logits = torch.tensor([p_s], dtype=torch.float64).log() + 3.0  # any shift: the softmax removes it
    t_logits = torch.tensor([p_t], dtype=torch.float64).log() - 1.0
    got = float(token_divergence(s_logits, t_logits, beta)[0])
    if beta == 0.0:
        want = sum(b * math.log(b / a) for a, b in zip(p_s, p_t))  # KL(p_T || p_S)
    elif beta == 1.0:
        want = sum(a * math.log(a / b) for a, b in zip(p_s, p_t))  # KL(p_S || p_T)
    else:
        want = _explicit(p_s, p_t, beta)
    assert got == pytest.approx(want, abs=1e-12)


def test_token_divergence_takes_the_temperature_and_carries_gradient_to_the_student_only():
    s = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    t = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    d = token_divergence(s, t, 1.0, temperature=2.0)
    assert torch.allclose(d, token_divergence(s / 2, t / 2, 1.0))
    d.sum().backward()
    assert s.grad is not None and t.grad is None
    assert float(token_divergence(s, s, 0.5).abs().max()) < 1e-12  # a teacher that agrees: no divergence


def test_divergence_beta_names_trl_s_ends():
    assert (divergence_beta("fkl", 0.3), divergence_beta("rkl", 0.3), divergence_beta("jsd", 0.3)) == (0.0, 1.0, 0.3)


def test_k1_and_k3_estimate_the_reverse_kl_without_bias():
    """Monte Carlo over samples of the student: the mean of k1 and of k3 is KL(p_S || p_T); k3 is never negative."""
    g = torch.Generator().manual_seed(0)
    log_s = torch.log_softmax(torch.randn(6, dtype=torch.float64, generator=g), -1)
    log_t = torch.log_softmax(torch.randn(6, dtype=torch.float64, generator=g), -1)
    exact = float((log_s.exp() * (log_s - log_t)).sum())
    o = torch.multinomial(log_s.exp(), 200_000, replacement=True, generator=g)
    e1, e3 = k1(log_s[o], log_t[o]), k3(log_s[o], log_t[o])
    assert float(e1.mean()) == pytest.approx(exact, abs=0.02)
    assert float(e3.mean()) == pytest.approx(exact, abs=0.02)
    assert float(e3.min()) >= 0.0


def test_correlation_from_summed_moments_is_pearson_s_over_the_union():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)
    y = 0.6 * x + y
    parts = [moment_sums(x[:20], y[:20]), moment_sums(x[20:], y[20:])]
    summed = [a + b for a, b in zip(*parts)]
    assert correlation(summed) == pytest.approx(float(torch.corrcoef(torch.stack([x, y]))[0, 1]), abs=1e-9)
    assert correlation(moment_sums(torch.ones(5), y[:5])) is None  # no spread on one side
