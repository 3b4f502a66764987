"""Estimator MSE in Gram space: the U-statistic view of GRPO [U-statistic, Sec. 4.1].

For one prompt, rollouts z_i = (o_i, r_i) are i.i.d. from the policy, psi_i is the
rollout's score (sum over its tokens of grad log pi; E[psi] = 0) and the true
gradient is mu = E[r psi]. With G rollouts the four estimators are

    vanilla  g = (1/G) sum_i r_i psi_i
    oracle   g = (1/G) sum_i (r_i - v) psi_i                 v = E[r], the true value
    rloo     g = (1/G) sum_i (r_i - mean_{j != i} r_j) psi_i  [U-statistic, Eq. 4]
    grpo     g = (1/G) sum_i (r_i - mean_j r_j) psi_i = (G-1)/G * rloo   [Foundations, Eq. 15]

The derivation, written out in full ([U-statistic, Sec. 4.1] states the results):

rloo is a second-order U-statistic (Lemma 1). Summing (r_i - r_j) psi_i over
ordered pairs and pairing (i, j) with (j, i),

    g_rloo = 1/(G(G-1)) sum_{i != j} (r_i - r_j) psi_i = C(G,2)^-1 sum_{i<j} h(z_i, z_j),
    h(z, z') = (r - r') (psi - psi') / 2,      E h = mu.

Hoeffding's decomposition: h_1(z) = E[h(z, Z')] - mu = ((r - v) psi - mu) / 2, so
zeta_1 = Var h_1 = sigma_O^2 / 4 with sigma_O^2 = E||(r - v) psi||^2 - ||mu||^2 the
oracle's per-rollout variance; zeta_2 = Var h = E||h||^2 - ||mu||^2. The variance of a
U-statistic of order 2 is (4 (G-2) zeta_1 + 2 zeta_2) / (G (G-1)); with
tau^2 = zeta_2 - 2 zeta_1 (the second-order term's E||h_2||^2) this is

    MSE_rloo(G)    = sigma_O^2 / G + 2 tau^2 / (G (G-1))        (Thm 2: oracle + residual)
    MSE_oracle(G)  = sigma_O^2 / G
    MSE_vanilla(G) = (E||r psi||^2 - ||mu||^2) / G
    MSE_grpo(G)    = c^2 MSE_rloo(G) + (1 - c)^2 ||mu||^2,   c = (G-1)/G  (biased by the factor c)

exactly, not just as bounds: every MSE is a fixed linear combination of four
per-prompt moments,

    A2 = E[r^2 Psi_ii]                              (vanilla's second moment)
    O2 = E[(r - v)^2 Psi_ii]                        (oracle's, sigma_O^2 = O2 - mu2)
    H2 = E||h||^2 = E[(r_i - r_j)^2 (Psi_ii - 2 Psi_ij + Psi_jj)] / 4,  i != j
    mu2 = ||mu||^2

with Psi_ij = <psi_i, psi_j> (:mod:`grpolab.probes.gram`). ``prompt_moments``
estimates each without bias from a pool of N >= 3 rollouts of the prompt, averaging
over *all* index tuples (a full U-statistic, which is what resampling groups from the
pool converges to, without the resampling noise):

    A2:  mean_i r_i^2 Psi_ii
    O2:  mean_i Psi_ii * q_i,  q_i = mean over distinct j, k != i of (r_i - r_j)(r_i - r_k);
         given z_i, E[(r_i - r_j)(r_i - r_k)] = (r_i - v)^2 because j, k are independent
         of i and of each other: the oracle value comes from rollouts disjoint from i.
    H2:  mean over i != j of (r_i - r_j)^2 (Psi_ii - 2 Psi_ij + Psi_jj) / 4
    mu2: mean over i != j of (r_i - b_ij)(r_j - b_ij) Psi_ij, b_ij the mean reward of the
         other N - 2 rollouts. Given b_ij, (r_i - b_ij) psi_i and (r_j - b_ij) psi_j are
         independent with mean mu (E psi = 0), so the product has mean ||mu||^2. Never
         i = j, which would add the variance.

Hence each estimator's MSE estimate is unbiased. Minibatch (Prop. 3): B prompts drawn
i.i.d., G rollouts each, rloo:

    MSE(B, G) = (1/B) [ sigma_P^2 + sigma_O^2 / G + 2 tau^2 / (G (G-1)) ]

(sigma_O^2 and tau^2 averaged over prompts), where sigma_P^2 = E_x ||mu(x) - grad J||^2
is the prompt-sampling variance; ``groupsize_constants`` estimates it as
mean_x mu2(x) - mean_{x != x'} <mu_hat(x), mu_hat(x')>, using independent unbiased
per-prompt gradient estimates for the cross pairs. Under a budget n = B G,

    MSE(G) = (G / n) sigma_P^2 + sigma_O^2 / n + 2 tau^2 / (n (G - 1)),

minimised at G* = 1 + sqrt(2 tau^2 / sigma_P^2), whatever n (Thm 7's universality).
(Writing the residual as c / G^2, as a bound does, gives G* = sqrt(c / sigma_P^2); the
exact G (G - 1) form moves it by about one.)
"""

from __future__ import annotations

import itertools
import math

import torch

from grpolab.algo.advantages import ESTIMATORS
from grpolab.common.stats import mean_ci  # noqa: F401  (re-exported: the probes summarise per-prompt values with it)

# The training estimators whose MSE is a closed form in the pooled moments; grpo_std divides by a random std
# and has none.
MSE_ESTIMATORS = tuple(e for e in ESTIMATORS if e != "grpo_std")  # vanilla, grpo, rloo, oracle


# ---------------------------------------------------------------- moments -> MSE


def mse_from_moments(m: dict[str, float], estimator: str, G: int) -> float:
    """Exact MSE of one prompt's G-rollout estimator from its four moments (module docstring)."""
    if estimator not in MSE_ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; choose from {MSE_ESTIMATORS}")
    min_g = 2 if estimator in ("grpo", "rloo") else 1
    if G < min_g:
        raise ValueError(f"estimator {estimator!r} needs G >= {min_g}, got {G}")
    mu2 = m["mu2"]
    sigma_o = m["O2"] - mu2
    if estimator == "vanilla":
        return (m["A2"] - mu2) / G
    if estimator == "oracle":
        return sigma_o / G
    tau2 = m["H2"] - mu2 - sigma_o / 2
    rloo = sigma_o / G + 2 * tau2 / (G * (G - 1))
    if estimator == "rloo":
        return rloo
    c = (G - 1) / G
    return c * c * rloo + (1 - c) ** 2 * mu2


def derived_constants(m: dict[str, float]) -> dict[str, float]:
    """sigma_O^2 and tau^2 of one prompt from its moments."""
    sigma_o = m["O2"] - m["mu2"]
    return {"sigma_oracle": sigma_o, "tau2": m["H2"] - m["mu2"] - sigma_o / 2}


# ---------------------------------------------------------------- unbiased moments from a pool


def _oracle_q(diff: torch.Tensor) -> torch.Tensor:
    """``[N]`` q_i = mean over ordered distinct (j, k), both != i, of (r_i - r_j)(r_i - r_k), from ``diff`` ``[N, N]``
    = r_i - r_j: an unbiased (r_i - v)^2 from rollouts other than i, whatever psi (module docstring, O2)."""
    N = diff.shape[0]
    s1 = diff.sum(dim=1)  # sum_{j != i} (r_i - r_j) (the j = i term is 0)
    s2 = (diff * diff).sum(dim=1)
    return (s1 * s1 - s2) / ((N - 1) * (N - 2))


def prompt_moments(psi: torch.Tensor, rewards: torch.Tensor) -> dict[str, float]:
    """Unbiased estimates of A2, O2, H2, mu2 from one prompt's pool.

    psi: ``[N, N]`` Gram matrix of the rollouts' scores; rewards: ``[N]``; N >= 3.
    """
    N = rewards.shape[0]
    if N < 3:
        raise ValueError(f"a pool needs N >= 3 rollouts per prompt, got {N}")
    P = psi.double()
    r = rewards.double()
    d = torch.diagonal(P)  # [N] Psi_ii
    off = ~torch.eye(N, dtype=torch.bool)  # [N, N] i != j
    A2 = (r * r * d).mean()
    diff = r[:, None] - r[None, :]  # [N, N] r_i - r_j
    O2 = (d * _oracle_q(diff)).mean()
    H2 = ((diff * diff) * (d[:, None] - 2 * P + d[None, :]) / 4)[off].mean()
    b = (r.sum() - r[:, None] - r[None, :]) / (N - 2)  # [N, N] mean of the other N-2 rewards
    mu2 = ((r[:, None] - b) * (r[None, :] - b) * P)[off].mean()
    return {"A2": float(A2), "O2": float(O2), "H2": float(H2), "mu2": float(mu2)}


def rows_mse(
    gram: torch.Tensor, rewards: torch.Tensor, G: int, max_subsets: int = 20000, seed: int = 0
) -> dict[str, float]:
    """MSE at G of the grpo, rloo and oracle estimators g = (1/G) sum_i A_i phi_i for per-rollout rows phi_i that
    need not be scores (E phi != 0: a length-normalised score phi_i = psi_i / |o_i|, the row of a seq-mean
    aggregation), about mu = E[(r - v) phi], the oracle's mean. ``prompt_moments`` assumes E psi = 0 (its mu2 and
    the Hoeffding terms); this does not, at the cost of enumerating subsets. Unbiased, from one prompt's pool:

        mu2 = ||mu||^2: mean over ordered distinct (a, b, c, d) of (r_a - r_b)(r_c - r_d) Phi_ac
            (E[(r_a - r_b) phi_a] = E[r phi] - v E[phi] = mu, and the two factors are independent);
        O2 = E[(r - v)^2 ||phi||^2]: mean_i Phi_ii q_i (``_oracle_q``, as in ``prompt_moments``: no E phi = 0);
        E||g||^2: mean over G-subsets S of the pool of ||(1/G) sum_{i in S} A_i phi_i||^2, A from S alone.

    Then MSE_oracle = (O2 - mu2) / G, MSE_rloo = E||g_rloo||^2 - mu2 (E g_rloo = mu) and MSE_grpo =
    E||g_grpo||^2 - (2c - 1) mu2 (g_grpo = c g_rloo, c = (G - 1) / G). All C(N, G) subsets when there are at most
    ``max_subsets``, else that many drawn at random (seeded; still unbiased).

    gram: ``[N, N]`` Phi_ij = <phi_i, phi_j>; rewards: ``[N]``; 4 <= N <= 48, 2 <= G <= N.
    """
    N = rewards.shape[0]
    if not 4 <= N <= 48:
        raise ValueError(f"rows_mse needs a pool of 4 to 48 rollouts, got {N}")
    if not 2 <= G <= N:
        raise ValueError(f"G must be in [2, {N}], got {G}")
    P = gram.double()
    r = rewards.double()
    diff = r[:, None] - r[None, :]  # [N, N] r_a - r_b
    mu2 = float(_mu_norm_sq(P, diff))
    O2 = float((torch.diagonal(P) * _oracle_q(diff)).mean())
    subsets = _subsets(N, G, max_subsets, seed)  # [S, G]
    rs = r[subsets]  # [S, G]
    Ps = P[subsets[:, :, None], subsets[:, None, :]]  # [S, G, G]

    def second_moment(a: torch.Tensor) -> float:  # mean over subsets of ||(1/G) sum_i a_i phi_i||^2
        return float(torch.einsum("si,sij,sj->s", a, Ps, a).mean()) / (G * G)

    grpo = rs - rs.mean(dim=1, keepdim=True)
    rloo = rs - (rs.sum(dim=1, keepdim=True) - rs) / (G - 1)
    c = (G - 1) / G
    return {
        "grpo": second_moment(grpo) - (2 * c - 1) * mu2,
        "rloo": second_moment(rloo) - mu2,
        "oracle": (O2 - mu2) / G,
        "mu2": mu2,
    }


def _mu_norm_sq(P: torch.Tensor, diff: torch.Tensor) -> torch.Tensor:
    """||mu||^2 without bias: the mean over ordered distinct (a, b, c, d) of diff_ab diff_cd P_ac (``rows_mse``), as
    one ``[N, N, N, N]`` tensor (N <= 48: at most 5.3 M entries)."""
    N = P.shape[0]
    ne = ~torch.eye(N, dtype=torch.bool)  # [N, N]
    distinct = torch.ones(N, N, N, N, dtype=torch.bool)
    for x, y in itertools.combinations(range(4), 2):  # every pair of the four indices differs
        view = [1, 1, 1, 1]
        view[x] = view[y] = N
        distinct &= ne.view(view)
    terms = diff[:, :, None, None] * diff[None, None, :, :] * P[:, None, :, None]  # [a, b, c, d]
    return terms[distinct].mean()


def _subsets(N: int, G: int, max_subsets: int, seed: int) -> torch.Tensor:
    """``[S, G]`` index sets: every G-subset of range(N) when there are at most ``max_subsets``, else that many
    drawn uniformly (seeded)."""
    if math.comb(N, G) <= max_subsets:
        return torch.tensor(list(itertools.combinations(range(N), G)))
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(N, generator=gen)[:G] for _ in range(max_subsets)])


def rloo_weights(rewards: torch.Tensor) -> torch.Tensor:
    """``[N]`` coefficients a_n of mu_hat = sum_n a_n psi_n, the leave-one-out estimate over the pool."""
    N = rewards.shape[0]
    r = rewards.double()
    return (r - (r.sum() - r) / (N - 1)) / N


EXACT_VECTOR_FLOATS = 2**28  # 1 GB of float32 leave-one-out vectors; beyond it they are sketched
SKETCH_DIM = 2**22


def sketch_dim_for(M: int, D: int) -> int:
    """0 (mu_hat kept whole) when M vectors of D floats fit in EXACT_VECTOR_FLOATS, else SKETCH_DIM: a real model's
    M x D floats would not fit in memory (32 x 135 M x 4 bytes = 17 GB)."""
    return 0 if M * D <= EXACT_VECTOR_FLOATS else SKETCH_DIM


def loo_vector(
    model,
    batch,
    rewards: torch.Tensor,
    params: dict[str, torch.nn.Parameter],
    temperature: float,
    sketch_dim: int = 0,
    seed: int = 0,
) -> torch.Tensor:
    """One prompt's leave-one-out gradient estimate mu_hat = sum_i a_i psi_i (``rloo_weights``) over its rollouts in
    ``batch``, psi_i the plain score (weight 1 per completion token: E[psi] = 0, so mu = E[r psi] is the true gradient;
    a length-normalised psi would not be a score). ``[D]`` over ``params`` (name -> parameter, in order), or its
    ``sketch_dim``-dimensional CountSketch ``[k]`` (each parameter hashed by its name and ``seed``: unbiased cross
    products). Equal rewards make every a_i, and so mu_hat, zero."""
    from grpolab.models.logprobs import completion_logprobs
    from grpolab.probes.gram import count_sketch

    if bool((rewards == rewards[0]).all()):
        return torch.zeros(sketch_dim or sum(p.numel() for p in params.values()))
    a = rloo_weights(rewards)  # [n]
    weights = batch.completion_mask.double() * a[:, None]  # [n, T]
    logp = completion_logprobs(model, batch, temperature)  # [n, T]
    grads = torch.autograd.grad((logp * weights.to(logp.dtype)).sum(), list(params.values()), allow_unused=True)
    blocks = [(g if g is not None else torch.zeros_like(p)).reshape(-1).float() for g, p in zip(grads, params.values())]
    if sketch_dim:  # each parameter's block hashed with its own (name-keyed) buckets and signs
        return sum(count_sketch(b[None], name, sketch_dim, seed)[0] for b, name in zip(blocks, params))  # [k]
    return torch.cat(blocks)  # [D]


# ---------------------------------------------------------------- summaries over prompts


def mse_table(moments: list[dict[str, float]], group_sizes: list[int], estimators=MSE_ESTIMATORS) -> list[dict]:
    """Per estimator and G: the mean over prompts of the per-prompt MSE, with a 95% CI over prompts."""
    rows = []
    for est in estimators:
        for G in group_sizes:
            if est in ("grpo", "rloo") and G < 2:
                continue
            mean, lo, hi = mean_ci([mse_from_moments(m, est, G) for m in moments])
            rows.append({"estimator": est, "G": G, "mse": mean, "ci_low": lo, "ci_high": hi})
    return rows


# ---------------------------------------------------------------- group size under a budget


def groupsize_constants(
    moments: list[dict[str, float]], cross: torch.Tensor, idx: torch.Tensor | None = None
) -> dict[str, float]:
    """sigma_P^2, mean sigma_O^2 and mean tau^2 over prompts (module docstring).

    cross: ``[M, M]`` inner products <mu_hat(x), mu_hat(x')> of independent per-prompt
    gradient estimates (only x != x' is used). ``idx``: a resample of prompt indices
    (bootstrap); pairs of the same original prompt are left out of the cross mean.
    """
    M = len(moments)
    idx = torch.arange(M) if idx is None else idx
    mu2 = torch.tensor([moments[i]["mu2"] for i in idx.tolist()], dtype=torch.float64)
    dc = [derived_constants(moments[i]) for i in idx.tolist()]
    pair = idx[:, None] != idx[None, :]
    if not pair.any():
        raise ValueError("sigma_P^2 needs at least two different prompts")
    grad_sq = cross.double()[idx][:, idx][pair].mean()  # ||grad J||^2, unbiased
    return {
        "sigma_prompt": float(mu2.mean() - grad_sq),
        "sigma_oracle": sum(c["sigma_oracle"] for c in dc) / len(dc),
        "tau2": sum(c["tau2"] for c in dc) / len(dc),
        "grad_norm_sq": float(grad_sq),
    }


def predicted_mse(c: dict[str, float], G: int, budget: int) -> float:
    """rloo minibatch MSE at G rollouts per prompt and B = budget / G prompts (Prop. 3)."""
    if G < 2:
        raise ValueError(f"G must be >= 2, got {G}")
    return (G * c["sigma_prompt"] + c["sigma_oracle"] + 2 * c["tau2"] / (G - 1)) / budget


def optimal_group_size(c: dict[str, float]) -> float:
    """G* = 1 + sqrt(2 tau^2 / sigma_P^2); inf when sigma_P^2 <= 0 (no prompt-sampling cost to balance)."""
    if c["sigma_prompt"] <= 0:
        return math.inf
    return 1.0 + math.sqrt(max(c["tau2"], 0.0) * 2 / c["sigma_prompt"])
