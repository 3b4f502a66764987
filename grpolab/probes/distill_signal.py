"""How much a rollout teaches under on-policy distillation, against GRPO: estimator MSE per rollout in Gram space.

For one prompt, rollouts o_i are i.i.d. from the student pi_S. Per rollout (D-dimensional gradient vectors):

    psi_i = sum_t grad log pi_S(o_t)                                   (the score; GRPO's row is A_i psi_i)
    e_i   = sum_t grad KL(pi_S(.|h_t) || pi_T(.|h_t))                  (the exact reverse-KL gradient over the whole
                                                                         vocabulary at the rollout's prefixes)
    a_i   = sum_t k1_t grad log pi_S(o_t),  k1_t = log pi_S(o_t) - log pi_T(o_t)   (rkl-reward's one-sample form)
    b_i   = sum_t k3_t grad log pi_S(o_t),  k3_t = r - log r - 1, r = pi_T / pi_S   (k3 used as a reward)

Given a prefix, E[k1_t grad log pi_S(o_t)] over o_t ~ pi_S is grad KL_t at that prefix (E grad log pi = 0), so
E a_i = E e_i = mu_KL: a is unbiased for OPD's target, with extra noise from sampling each token; b is not
(E[k3 grad log pi] = E[k1 grad log pi] + sum_v pi_T(v) grad log pi_S(v)). GRPO's target is mu_R = E[(r - v) psi].

Every quantity below is an unbiased estimate from one prompt's pool of N rollouts, written with Gram blocks
``XY[i, j] = <x_i, y_j>`` and means over distinct indices (a U-statistic, as :mod:`grpolab.probes.mse` does):

    ||E x||^2        = mean_{i != j} XX_ij
    <E x, E y>       = mean_{i != j} XY_ij
    E||xbar_G - mu||^2 = (mean_i XX_ii - ||E x||^2) / G + ||E x - mu||^2     (xbar_G: the mean of G rollouts' x)

The mix (GRPO + lambda OPD, rkl-reward: each token's advantage A_i + lambda (log pi_T - log pi_S)) has the
per-rollout row A_i psi_i - lambda a_i, an ascent on mu_R - lambda mu_KL.
"""

from __future__ import annotations

import torch

from grpolab.probes.mse import prompt_moments


def off_mean(M: torch.Tensor) -> float:
    """The mean of ``M`` ``[N, N]`` over i != j: an unbiased <E x, E y> when ``M[i, j] = <x_i, y_j>`` for i.i.d.
    pairs (x_i, y_i)."""
    N = M.shape[0]
    off = ~torch.eye(N, dtype=torch.bool, device=M.device)
    return float(M.double()[off].mean())


def mean_estimator_mse(XX: torch.Tensor, XE: torch.Tensor, EE: torch.Tensor, G: int) -> float:
    """E||xbar_G - mu||^2: the MSE of the mean of G rollouts' ``x`` as an estimate of ``mu = E e``, from one pool's
    Gram blocks ``XX``, ``XE`` (``<x_i, e_j>``), ``EE``, each ``[N, N]``, N >= 2: the variance part
    (mean_i XX_ii - ||E x||^2) / G plus the squared bias ||E x - mu||^2 (0 in expectation for an unbiased x)."""
    xx, xe, ee = off_mean(XX), off_mean(XE), off_mean(EE)
    return (float(torch.diagonal(XX).double().mean()) - xx) / G + (xx - 2 * xe + ee)


def reward_cross(R: torch.Tensor, PE: torch.Tensor) -> float:
    """<mu_R, mu_E> without bias: the mean over distinct (a, b, c) of (r_a - r_b) <psi_a, e_c>
    (E[(r_a - r_b) psi_a] = mu_R for b != a, independent of e_c). ``R`` ``[N]`` rewards, ``PE`` ``[N, N]`` the
    blocks ``<psi_i, e_j>``; N >= 3."""
    r = R.double()
    N = r.shape[0]
    diff = r[:, None] - r[None, :]  # [a, b]
    terms = diff[:, :, None] * PE.double()[:, None, :]  # [a, b, c]
    idx = torch.arange(N)
    distinct = (idx[:, None, None] != idx[None, :, None]) & (idx[:, None, None] != idx[None, None, :])
    distinct &= idx[None, :, None] != idx[None, None, :]
    return float(terms[distinct].mean())


def cosine(dot: float, a2: float, b2: float) -> float:
    """<a, b> / (|a| |b|) from unbiased estimates (nan where a norm estimate is not positive)."""
    return dot / (a2 * b2) ** 0.5 if a2 > 0 and b2 > 0 else float("nan")


def mix_mse(blocks: dict[str, torch.Tensor], rewards: torch.Tensor, lam: float, subsets: torch.Tensor) -> dict:
    """MSE of the mix g = (1/G) sum_{i in S} ((r_i - rbar_S) psi_i - lam a_i) about its target mu_R - lam mu_KL (its
    ascent direction: GRPO's group-mean term and rkl-reward's), over the G-subsets ``subsets`` ``[S, G]`` of one
    pool; lam = 0 is GRPO alone (group-mean baseline, E g = c mu_R with c = (G - 1) / G), and a pool's all-equal
    rewards give it nothing but the teacher's term.

    ``blocks``: the pool's Gram blocks ``PP`` (<psi_i, psi_j>), ``PA``, ``AA``, ``PE``, ``EE``, each ``[N, N]``; N >= 4.
    Returns the MSE, the target's squared norm and its parts: ``mu2_R``, ``mu2_KL`` and ``cross`` = <mu_R, mu_KL>,
    and the score's pool moments (:func:`grpolab.probes.mse.prompt_moments`, GRPO's own MSE).
    """
    r = rewards.double()
    G = subsets.shape[1]
    c = (G - 1) / G
    moments = prompt_moments(blocks["PP"], r)
    mu2_r = moments["mu2"]
    mu2_kl, cross = off_mean(blocks["EE"]), reward_cross(r, blocks["PE"])
    rs = r[subsets]  # [S, G]
    A = rs - rs.mean(dim=1, keepdim=True)  # [S, G]
    take = subsets[:, :, None], subsets[:, None, :]
    PP, PA, AA = (blocks[k].double()[take] for k in ("PP", "PA", "AA"))  # [S, G, G] each
    second = torch.einsum("si,sij,sj->s", A, PP, A) - 2 * lam * torch.einsum("si,sij->s", A, PA)
    second = (second + lam * lam * AA.sum(dim=(1, 2))) / (G * G)  # [S] ||g_S||^2
    target2 = mu2_r - 2 * lam * cross + lam * lam * mu2_kl
    mean_dot = c * mu2_r - (c + 1) * lam * cross + lam * lam * mu2_kl  # <E g, target>
    mse = float(second.mean()) - 2 * mean_dot + target2
    return {"mse": mse, "target2": target2, "mu2_R": mu2_r, "mu2_KL": mu2_kl, "cross": cross, "moments": moments}
