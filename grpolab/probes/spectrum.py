"""Spectrum of the per-rollout gradient matrix [Foundations, Sec. 7].

G (R x D) has rows A_i psi_i. Its singular values are the square roots of the
eigenvalues of K = G G^T = diag(A) Psi diag(A), with Psi_ij = <psi_i, psi_j>,
so the R x R Gram matrix is all that is needed: D never appears.
"""

from __future__ import annotations

import torch

RANK_RTOL = 1e-6
"""Numerical rank counts singular values above RANK_RTOL * s_max. Singular values come
from eigenvalues of K, accurate to about eps * ||K|| = eps * s_max^2 in fp64, i.e. to
sqrt(eps) * s_max ~ 1.5e-8 s_max; 1e-6 leaves a wide margin above that noise while
catching any direction carrying more than 1e-12 of the energy."""


def advantage_gram(psi: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """K = G G^T = diag(A) Psi diag(A) ``[R, R]`` (float64) from Psi ``[R, R]`` and A ``[R]``: the Gram matrix of the
    rows A_i psi_i, for whichever estimator gave A."""
    a = advantages.double()
    K = a[:, None] * psi.double() * a[None, :]
    return 0.5 * (K + K.T)  # symmetric up to rounding; eigvalsh wants exact symmetry


def singular_values_from_gram(psi: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Singular values ``[R]`` (descending) of G = diag(A) Psi^(1/2) from Psi ``[R, R]`` and A ``[R]``."""
    eig = torch.linalg.eigvalsh(advantage_gram(psi, advantages)).flip(0)  # descending
    return eig.clamp(min=0.0).sqrt()


def spectrum_metrics(s: torch.Tensor, rtol: float = RANK_RTOL) -> dict[str, float]:
    """Metrics of singular values ``s`` (any order).

    - ``num_rank``: number of s_k > rtol * s_max (see RANK_RTOL);
    - ``effective_rank``: (sum s)^2 / sum s^2 [Foundations, Sec. 7], between 1 and num_rank;
    - ``top1_fraction``: s_1^2 / sum s^2, the share of energy in the top direction;
    - ``stable_rank``: sum s^2 / s_1^2 = 1 / top1_fraction.

    An all-zero spectrum (every advantage 0) has rank 0 and the other metrics 0, never NaN.
    """
    s = s.double().abs()
    s_max = s.max() if s.numel() else torch.tensor(0.0, dtype=torch.float64)
    if s_max == 0:
        return {"num_rank": 0, "effective_rank": 0.0, "top1_fraction": 0.0, "stable_rank": 0.0}
    energy = s.pow(2).sum()
    return {
        "num_rank": int((s > rtol * s_max).sum()),
        "effective_rank": float(s.sum().pow(2) / energy),
        "top1_fraction": float(s_max.pow(2) / energy),
        "stable_rank": float(energy / s_max.pow(2)),
    }


def advantage_effective_rank(adv: torch.Tensor) -> float:
    """(sum |A_i|)^2 / sum A_i^2: the effective rank G would have if the scores psi_i were orthonormal, the part of
    the rank the advantages alone set. For rewards in {0, 1} with k of R correct and group-mean advantages it is
    4 R p(1 - p), p = k / R, i.e. 4 R sigma_r^2 with sigma_r^2 the group's reward variance (0 for a group of equal
    rewards)."""
    a = adv.double().abs()
    energy = a.pow(2).sum()
    return float(a.sum().pow(2) / energy) if energy > 0 else 0.0
