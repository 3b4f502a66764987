"""Tests of grpolab.probes.spectrum: metrics of the per-rollout gradient matrix's spectrum.

Unit: planted singular values with hand-computed effective rank, top-1 fraction and
stable rank [Foundations, Sec. 7]. Statistical (seeded): singular values from the R x R
Gram matrix against an SVD of G itself, and planted low-rank matrices.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpolab.probes.spectrum import RANK_RTOL, singular_values_from_gram, spectrum_metrics

# ---------------------------------------------------------------- spectrum_metrics, by hand


def _check(m: dict, num_rank, eff, top1, stable):
    assert m["num_rank"] == num_rank
    assert isinstance(m["num_rank"], int)
    assert m["effective_rank"] == pytest.approx(eff, rel=1e-12)
    assert m["top1_fraction"] == pytest.approx(top1, rel=1e-12)
    assert m["stable_rank"] == pytest.approx(stable, rel=1e-12)


def test_single_direction():
    # s = (3, 0, 0): (sum s)^2 / sum s^2 = 9/9 = 1; s1^2 / sum s^2 = 9/9 = 1; sum s^2 / s1^2 = 1
    _check(spectrum_metrics(torch.tensor([3.0, 0.0, 0.0])), num_rank=1, eff=1.0, top1=1.0, stable=1.0)


def test_two_equal_directions():
    # s = (1, 1): (1+1)^2 / (1+1) = 2; top-1 = 1/2; stable = 2/1 = 2
    _check(spectrum_metrics(torch.tensor([1.0, 1.0])), num_rank=2, eff=2.0, top1=0.5, stable=2.0)


@pytest.mark.parametrize("s", [[2.0, 1.0], [1.0, 2.0], [1.0, 0.0, 2.0]])
def test_two_unequal_directions_in_any_order(s):
    # s = (2, 1): (2+1)^2 / (4+1) = 9/5; top-1 = 4/5; stable = 5/4
    _check(spectrum_metrics(torch.tensor(s)), num_rank=2, eff=9 / 5, top1=4 / 5, stable=5 / 4)


def test_three_directions_float64():
    # s = (3, 2, 1): (6)^2 / 14 = 18/7; top-1 = 9/14; stable = 14/9
    _check(
        spectrum_metrics(torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64)),
        num_rank=3,
        eff=18 / 7,
        top1=9 / 14,
        stable=14 / 9,
    )


@pytest.mark.parametrize("s", [torch.zeros(4), torch.zeros(1), torch.zeros(0)])
def test_all_zero_spectrum_is_rank_zero_without_nan(s):
    m = spectrum_metrics(s)
    assert m == {"num_rank": 0, "effective_rank": 0.0, "top1_fraction": 0.0, "stable_rank": 0.0}
    assert not any(math.isnan(v) for v in m.values())


def test_values_below_rank_rtol_do_not_count_in_num_rank():
    # 0.5 * RANK_RTOL * s_max is noise, 2 * RANK_RTOL * s_max is a direction
    s = torch.tensor([10.0, 10.0 * 0.5 * RANK_RTOL, 10.0 * 2 * RANK_RTOL, 3.0], dtype=torch.float64)
    m = spectrum_metrics(s)
    assert m["num_rank"] == 3
    # the other metrics still use every value: (10 + 3 + 2.5e-5)^2 / (100 + 9 + ...) ~ 169/109
    assert m["effective_rank"] == pytest.approx(169 / 109, rel=1e-5)
    # a custom tolerance moves the cut
    assert spectrum_metrics(s, rtol=0.5)["num_rank"] == 1  # only s > 5: the 10
    assert spectrum_metrics(s, rtol=0.2)["num_rank"] == 2  # s > 2: 10 and 3


def test_rank_rtol_is_above_eigenvalue_noise():
    # Singular values from eigenvalues of K = G G^T carry an absolute error ~ sqrt(eps64) * s_max
    # ~ 1.5e-8 s_max (spectrum.py's note); the cut must sit well above it and keep 1e-12 of the energy.
    assert math.sqrt(torch.finfo(torch.float64).eps) < RANK_RTOL / 10
    assert RANK_RTOL**2 <= 1e-12


# ---------------------------------------------------------------- singular_values_from_gram


def _orthonormal(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    return q  # [n, k], orthonormal columns


def test_planted_singular_values_with_unit_advantages():
    # G0 = U diag(sigma) V^T, U [R, R] and V [D, R] orthonormal: the singular values are sigma exactly.
    gen = torch.Generator().manual_seed(0)
    R, D = 6, 50
    sigma = torch.tensor([5.0, 3.0, 2.0, 1.0, 0.5, 0.1], dtype=torch.float64)
    G0 = _orthonormal(R, R, gen) @ torch.diag(sigma) @ _orthonormal(D, R, gen).T  # [R, D]
    s = singular_values_from_gram(G0 @ G0.T, torch.ones(R))
    assert s.dtype == torch.float64 and s.shape == (R,)
    torch.testing.assert_close(s, sigma, rtol=1e-8, atol=0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_singular_values_from_gram_equal_svd_of_g(seed):
    gen = torch.Generator().manual_seed(seed)
    R, D = 8, 50
    G0 = (
        torch.randn(R, D, generator=gen, dtype=torch.float64)
        * torch.linspace(0.2, 3.0, R, dtype=torch.float64)[:, None]
    )
    A = torch.randn(R, generator=gen, dtype=torch.float64)
    A = A - A.mean()  # zero-sum, as GRPO's advantages
    expected = torch.linalg.svdvals(torch.diag(A) @ G0)  # [R] descending, independent path
    got = singular_values_from_gram(G0 @ G0.T, A)
    assert (got[:-1] >= got[1:]).all()  # descending
    torch.testing.assert_close(got, expected, rtol=1e-8, atol=0)


def test_float32_inputs_are_promoted():
    gen = torch.Generator().manual_seed(4)
    G0 = torch.randn(4, 50, generator=gen, dtype=torch.float64)
    A = torch.tensor([0.5, -0.25, -0.5, 0.25], dtype=torch.float32)
    expected = torch.linalg.svdvals(torch.diag(A.double()) @ G0)
    got = singular_values_from_gram((G0 @ G0.T).float(), A)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def test_planted_rank_two():
    # R = 8 rows in the span of 2 vectors: the rank is 2 whatever the advantages; the effective
    # rank lies in [1, 2] and the eigenvalue noise of the 6 null directions stays under the cut.
    gen = torch.Generator().manual_seed(5)
    R, D = 8, 50
    basis = torch.randn(2, D, generator=gen, dtype=torch.float64)
    G0 = torch.randn(R, 2, generator=gen, dtype=torch.float64) @ basis  # [R, D], rank 2
    A = torch.randn(R, generator=gen, dtype=torch.float64)
    A = A - A.mean()
    s = singular_values_from_gram(G0 @ G0.T, A)
    m = spectrum_metrics(s)
    assert m["num_rank"] == 2
    assert 1.0 <= m["effective_rank"] <= 2.0
    expected = torch.linalg.svdvals(torch.diag(A) @ G0)[:2]
    torch.testing.assert_close(s[:2], expected, rtol=1e-8, atol=0)
    assert s[2:].max() < RANK_RTOL * s[0]


def test_planted_rank_one():
    gen = torch.Generator().manual_seed(6)
    v = torch.randn(1, 50, generator=gen, dtype=torch.float64)
    G0 = torch.arange(1.0, 6.0, dtype=torch.float64)[:, None] * v  # [5, 50], rows multiples of v
    m = spectrum_metrics(singular_values_from_gram(G0 @ G0.T, torch.tensor([1.0, -2.0, 0.5, 0.25, 0.25])))
    assert m["num_rank"] == 1
    assert m["effective_rank"] == pytest.approx(1.0, abs=1e-6)
    assert m["top1_fraction"] == pytest.approx(1.0, abs=1e-12)


def test_zero_sum_advantages_leave_full_rank():
    # rank(diag(A) G0) = number of non-zero advantages: a zero-sum A removes no row
    # (R = 2: rows a psi_1 and -a psi_2 are independent), so the largest possible rank is R.
    gen = torch.Generator().manual_seed(7)
    for R in (2, 4, 8):
        G0 = torch.randn(R, 50, generator=gen, dtype=torch.float64)
        A = torch.randn(R, generator=gen, dtype=torch.float64)
        A = A - A.mean()
        assert spectrum_metrics(singular_values_from_gram(G0 @ G0.T, A))["num_rank"] == R
        A[0] = 0.0  # one zero advantage removes exactly one row
        assert spectrum_metrics(singular_values_from_gram(G0 @ G0.T, A))["num_rank"] == R - 1


def test_zero_advantages_give_all_zero_singular_values():
    gen = torch.Generator().manual_seed(8)
    G0 = torch.randn(4, 50, generator=gen, dtype=torch.float64)
    s = singular_values_from_gram(G0 @ G0.T, torch.zeros(4))
    assert s.shape == (4,)
    assert torch.equal(s, torch.zeros(4, dtype=torch.float64))
    assert spectrum_metrics(s)["num_rank"] == 0
