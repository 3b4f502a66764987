"""A noisy reward against a verifier [U-statistic, Thm 2]: what each estimator's MSE becomes when its rewards are a
model's rather than the verifier's.

The same pool scored twice: by a verifier, r, and by a model (a reward model's logit, a judge's score), put on the
verifier's scale as r~ = a m + b (``affine_calibration``; b drops out of grpo, rloo and oracle, whose baselines
shift with it; the slope a scales the gradient). Derivation: ``noisy_reward_moments`` and
``predicted_noisy_moments``.
"""

from __future__ import annotations

import math
import statistics

import torch

from grpolab.probes.mse import mse_from_moments, prompt_moments

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
