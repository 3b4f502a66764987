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
import statistics

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


# ---------------------------------------------------------------- the softmax bandit: exact answers


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


# ---------------------------------------------------------------- a noisy reward against a verifier
#
# The same pool scored twice: by a verifier, r, and by a model (a reward model's logit, a judge's score), put on the
# verifier's scale as r~ = a m + b (``affine_calibration``; b drops out of grpo, rloo and oracle, whose baselines
# shift with it; the slope a scales the gradient). Derivation: ``noisy_reward_moments`` and
# ``predicted_noisy_moments``.

NOISE_ESTIMATORS = ("grpo", "rloo", "oracle")  # those whose bias does not depend on the reward's offset b


def noisy_reward_moments(psi: torch.Tensor, r_ref: torch.Tensor, r_model: torch.Tensor) -> dict:
    """What the MSE of an estimator built on ``r_model`` against the gradient of ``r_ref`` needs, per prompt, each
    unbiased from one prompt's pool [U-statistic, Thm 2] (``prompt_moments``).

    psi: ``[N, N]`` Gram matrix of the rollouts' scores; r_ref, r_model: ``[N]`` (r_model on r_ref's scale); N >= 3.
    Returns ``ref`` and ``model`` (each reward's A2, O2, H2, mu2), ``bias2`` = ||mu~ - mu||^2, ``cross`` =
    <mu~, mu> and ``psi2`` = E||psi||^2, with mu = E[r psi] and mu~ = E[r~ psi].

    An estimator g~ on r~ has mean k mu~ (k = c = (G - 1) / G for grpo, 1 for rloo and oracle), so

        E||g~ - mu||^2 = E||g~ - k mu~||^2 + ||k mu~ - mu||^2
                       = spread(G) + k^2 ||mu~||^2 - 2 k <mu~, mu> + ||mu||^2      (``mse_against_reference``)

    with spread the estimator's MSE about its own mean: Thm 2 on r~'s moments for rloo and oracle, c^2 times rloo's
    for grpo (g_grpo = c g_rloo). Since E psi = 0, E[(r~ - r) psi] = mu~ - mu, so ||mu~ - mu||^2 is ``prompt_moments``'
    mu2 of the difference r~ - r, and <mu~, mu> = (||mu~||^2 + ||mu||^2 - ||mu~ - mu||^2) / 2 (polarisation: three
    unbiased terms). For grpo the sum is c^2 MSE_rloo~ + c ||mu~ - mu||^2 + (1 - c) ||mu||^2 - c (1 - c) ||mu~||^2.
    As G grows every estimator's MSE falls to ||mu~ - mu||^2, which no group size removes.
    """
    ref = prompt_moments(psi, r_ref)
    model = prompt_moments(psi, r_model)
    bias2 = prompt_moments(psi, r_model.double() - r_ref.double())["mu2"]
    cross = (model["mu2"] + ref["mu2"] - bias2) / 2
    psi2 = float(torch.diagonal(psi.double()).mean())
    return {"ref": ref, "model": model, "bias2": bias2, "cross": cross, "psi2": psi2}


def _mean_scale(estimator: str, G: int) -> float:
    """k with E g~ = k mu~: c = (G - 1) / G for grpo (its mean baseline includes the rollout itself), else 1."""
    return (G - 1) / G if estimator == "grpo" else 1.0


def estimator_spread(m: dict[str, float], estimator: str, G: int) -> float:
    """E||g - E g||^2 of one prompt's G-rollout estimator from its reward's moments ``m``: rloo's and oracle's MSE
    (both unbiased), c^2 times rloo's for grpo."""
    if estimator not in NOISE_ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; choose from {NOISE_ESTIMATORS}")
    if estimator == "grpo":
        return _mean_scale("grpo", G) ** 2 * mse_from_moments(m, "rloo", G)
    return mse_from_moments(m, estimator, G)


def mse_against_reference(nm: dict, estimator: str, G: int) -> float:
    """E||g~ - mu||^2: the G-rollout estimator on the model's reward against the verifier's true gradient, from one
    prompt's ``noisy_reward_moments`` ``nm``. With r~ = r (bias2 0, cross mu2) it is ``mse_from_moments``."""
    k = _mean_scale(estimator, G)
    spread = estimator_spread(nm["model"], estimator, G)
    return spread + k * k * nm["model"]["mu2"] - 2 * k * nm["cross"] + nm["ref"]["mu2"]


def predicted_noisy_moments(ref: dict[str, float], psi2: float, noise_var: float, slope: float = 1.0) -> dict:
    """The ``noisy_reward_moments`` a model reward r~ = slope * r + e would have, e independent of the rollout with
    mean 0 and variance ``noise_var`` (s^2), from the verifier's moments ``ref`` and E||psi||^2 ``psi2``.

    With v = E r, Psi_ii = ||psi_i||^2 and E<psi_i, psi_j> = 0 for i != j (E psi = 0, rollouts independent):

        O2:  E[(k (r - v) + e)^2 Psi_ii]                = k^2 O2 + s^2 psi2
        H2:  E[(k (r_i - r_j) + e_i - e_j)^2 ||psi_i - psi_j||^2] / 4
             = k^2 H2 + (2 s^2)(2 psi2) / 4              = k^2 H2 + s^2 psi2
        mu2: ||E[(k r + e) psi]||^2                     = k^2 mu2;    A2 (offset 0): k^2 A2 + s^2 psi2
        bias2 = (1 - k)^2 mu2,  cross = k mu2

    With k = 1 (noise alone): sigma_O^2 = O2 - mu2 grows by s^2 psi2 and tau^2 = H2 - mu2 - sigma_O^2 / 2 by
    s^2 psi2 / 2 (H2 gains the full s^2 psi2, not half), so [U-statistic, Thm 2] gives

        MSE_oracle + s^2 psi2 / G,   MSE_rloo + s^2 psi2 / (G - 1),   MSE_grpo + s^2 psi2 (G - 1) / G^2:

    rloo's leave-one-out baseline carries the other rollouts' noise, E(e_i - mean_{j != i} e_j)^2 = s^2 G / (G - 1),
    where the oracle's true value carries none. Under a budget n = B G the noise adds s^2 psi2 (1 + 1 / (G - 1)) / n
    to Prop. 3's MSE, so the best group size moves up: G* = 1 + sqrt((2 tau^2 + s^2 psi2) / sigma_P^2).
    """
    k2 = slope * slope
    noise = noise_var * psi2
    model = {
        "A2": k2 * ref["A2"] + noise,
        "O2": k2 * ref["O2"] + noise,
        "H2": k2 * ref["H2"] + noise,
        "mu2": k2 * ref["mu2"],
    }
    return {
        "ref": dict(ref),
        "model": model,
        "bias2": (1 - slope) ** 2 * ref["mu2"],
        "cross": slope * ref["mu2"],
        "psi2": psi2,
    }


# ---------------------------------------------------------------- fits over the pool


def affine_calibration(r_model: torch.Tensor, r_ref: torch.Tensor) -> tuple[float, float]:
    """(a, b) of the least-squares r_ref ~ a r_model + b over every rollout (any shape, flattened); a = 0 when the
    model's scores do not vary."""
    x, y = r_model.double().reshape(-1), r_ref.double().reshape(-1)
    var = float(((x - x.mean()) ** 2).sum())
    a = float(((x - x.mean()) * (y - y.mean())).sum()) / var if var > 0 else 0.0
    return a, float(y.mean() - a * x.mean())


def within_prompt_variance(x: torch.Tensor) -> float:
    """Pooled within-prompt variance of ``x`` ``[M, N]``: sum over prompts of sum_i (x_i - mean_x)^2, over M (N - 1)."""
    M, N = x.shape
    xd = x.double()
    return float(((xd - xd.mean(dim=1, keepdim=True)) ** 2).sum()) / (M * (N - 1))


def within_prompt_slope(y: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """(k, s^2) of y = k x + c_prompt + e pooled within prompts (each prompt its own intercept), ``[M, N]`` each:
    k = sum (x - mean)(y - mean) / sum (x - mean)^2 over all rollouts, s^2 = residual sum of squares over its
    M (N - 1) - 1 degrees of freedom. k is nan when x never varies within a prompt."""
    M, N = x.shape
    xc = x.double() - x.double().mean(dim=1, keepdim=True)  # [M, N]
    yc = y.double() - y.double().mean(dim=1, keepdim=True)
    sxx = float((xc * xc).sum())
    if sxx == 0:
        return math.nan, float((yc * yc).sum()) / (M * (N - 1))
    k = float((xc * yc).sum()) / sxx
    return k, float(((yc - k * xc) ** 2).sum()) / (M * (N - 1) - 1)


def agreement(r_ref: torch.Tensor, r_cal: torch.Tensor, threshold: float = 0.5) -> dict[str, float]:
    """One prompt's ``[N]`` rewards: ``accuracy``, the share of rollouts where [r_cal >= threshold] equals
    [r_ref >= threshold] (the calibrated model reward as a classifier of the verifier's pass/fail); ``pearson``, the
    correlation of the two within the group (nan when either does not vary); ``auroc``, the chance that a rollout
    the verifier passes has the higher r_cal than one it fails, ties counting 1/2 (no threshold; nan unless the group
    holds both)."""
    x, y = r_cal.double(), r_ref.double()
    passed = y >= threshold  # [N]
    accuracy = float(((x >= threshold) == passed).double().mean())
    xc, yc = x - x.mean(), y - y.mean()
    denom = float((xc * xc).sum() * (yc * yc).sum())
    pearson = float((xc * yc).sum()) / math.sqrt(denom) if denom > 0 else math.nan
    pos, neg = x[passed], x[~passed]
    if len(pos) and len(neg):
        d = pos[:, None] - neg[None, :]  # [P, F]
        auroc = float(((d > 0).double() + 0.5 * (d == 0).double()).mean())
    else:
        auroc = math.nan
    return {"accuracy": accuracy, "pearson": pearson, "auroc": auroc}


def matching_group_size(nms: list[dict], estimator: str, target: float, g_max: int = 1024) -> float | None:
    """The smallest G in 2..g_max at which the mean over prompts of ``mse_against_reference`` is at most ``target``;
    None ("never") when the bias ||mu~ - mu||^2 alone (the limit as G grows) is at least ``target``; inf when it is
    not reached by g_max."""
    if statistics.fmean(nm["bias2"] for nm in nms) >= target:
        return None
    for G in range(2, g_max + 1):
        if statistics.fmean(mse_against_reference(nm, estimator, G) for nm in nms) <= target:
            return G
    return math.inf


def best_scale(nms: list[dict], estimator: str, G: int) -> tuple[float, float]:
    """(lambda*, MSE*): the factor lambda on the model's reward (one for every prompt: a step size) minimising the
    mean over prompts of E||lambda g~ - mu||^2, and that minimum. The MSE is lambda^2 E||g~||^2 - 2 lambda k <mu~, mu>
    + ||mu||^2 with E||g~||^2 = spread + k^2 ||mu~||^2: a scale-free view (the same for every affine map of the
    model's score)."""
    k = _mean_scale(estimator, G)
    second = statistics.fmean(estimator_spread(nm["model"], estimator, G) + k * k * nm["model"]["mu2"] for nm in nms)
    cross = statistics.fmean(k * nm["cross"] for nm in nms)
    ref = statistics.fmean(nm["ref"]["mu2"] for nm in nms)
    if second <= 0:
        return 0.0, ref
    return cross / second, ref - cross * cross / second


def gradient_cosine(nms: list[dict]) -> float:
    """cos(mu~, mu) of the per-prompt gradients stacked over prompts: sum <mu~, mu> / sqrt(sum ||mu~||^2 sum ||mu||^2)
    (scale-free; nan when a sum of squared norms is not positive, which unbiased estimates can be)."""
    cross = sum(nm["cross"] for nm in nms)
    a = sum(nm["model"]["mu2"] for nm in nms)
    b = sum(nm["ref"]["mu2"] for nm in nms)
    return cross / math.sqrt(a * b) if a > 0 and b > 0 else math.nan
