"""A noisy (model-given) reward against a verifier, in Gram space [U-statistic, Thm 2]: the MSE against the
verifier's gradient, the prediction under independent noise (checked by Monte Carlo on a softmax bandit), the pooled
estimates' unbiasedness, the fits and summaries, and benchmarks/reward_noise.py end to end on the built-in model."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from helpers.paths import REPO

from grpolab.probes.bandit import bandit_estimates, bandit_moments, bandit_pool_gram, bandit_true_gradient
from grpolab.probes.mse import mean_ci, mse_from_moments
from grpolab.probes.reward_noise import (
    NOISE_ESTIMATORS,
    affine_calibration,
    agreement,
    best_scale,
    estimator_spread,
    gradient_cosine,
    matching_group_size,
    mse_against_reference,
    noisy_reward_moments,
    predicted_noisy_moments,
    within_prompt_slope,
    within_prompt_variance,
)

P = torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)
THETA = torch.tensor([0.0, 0.5, -0.5], dtype=torch.float64)
PI = torch.softmax(THETA, 0)
PSI2 = float((PI * (1 - 2 * PI + (PI * PI).sum())).sum())  # E||e_a - pi||^2
REF = bandit_moments(P, THETA)
ROOT = REPO


def _noisy_draws(G: int, trials: int, slope: float, s: float, seed: int):
    """``trials`` groups of G bandit rollouts: arms, verifier rewards and r~ = slope r + N(0, s^2), each ``[trials, G]``."""
    gen = torch.Generator().manual_seed(seed)
    arms = torch.multinomial(PI.expand(trials, -1), G, replacement=True, generator=gen)
    r = torch.bernoulli(P[arms], generator=gen)
    return arms, r, slope * r + s * torch.randn(trials, G, generator=gen, dtype=torch.float64)


# ---------------------------------------------------------------- closed forms


@pytest.mark.parametrize("G", [2, 3, 4, 8, 16])
def test_independent_noise_adds_its_variance_over_g_or_g_minus_one(G):
    s2 = 0.3
    noisy = predicted_noisy_moments(REF, PSI2, s2)
    added = {e: mse_against_reference(noisy, e, G) - mse_from_moments(REF, e, G) for e in NOISE_ESTIMATORS}
    assert added["oracle"] == pytest.approx(s2 * PSI2 / G, rel=1e-12)
    assert added["rloo"] == pytest.approx(s2 * PSI2 / (G - 1), rel=1e-12)
    assert added["grpo"] == pytest.approx(s2 * PSI2 * (G - 1) / G**2, rel=1e-12)
    tau = {k: v["H2"] - v["mu2"] - (v["O2"] - v["mu2"]) / 2 for k, v in (("ref", REF), ("model", noisy["model"]))}
    assert tau["model"] - tau["ref"] == pytest.approx(s2 * PSI2 / 2, rel=1e-12)  # tau^2 moves: G* moves up


def test_no_noise_and_the_verifier_itself_give_the_verifier_mse():
    same = predicted_noisy_moments(REF, PSI2, 0.0)
    for est in NOISE_ESTIMATORS:
        for G in (2, 5):
            assert mse_against_reference(same, est, G) == pytest.approx(mse_from_moments(REF, est, G), rel=1e-12)
    gen = torch.Generator().manual_seed(1)
    arms = torch.randint(0, 3, (8,), generator=gen)
    r = torch.bernoulli(P[arms], generator=gen)
    nm = noisy_reward_moments(bandit_pool_gram(arms, PI), r, r)
    assert nm["bias2"] == 0 and nm["cross"] == pytest.approx(nm["ref"]["mu2"], rel=1e-12)
    for est in NOISE_ESTIMATORS:
        assert mse_against_reference(nm, est, 4) == pytest.approx(mse_from_moments(nm["ref"], est, 4), rel=1e-9)


def test_an_offset_drops_out_and_a_per_prompt_shift_has_no_bias():
    gen = torch.Generator().manual_seed(2)
    arms = torch.randint(0, 3, (10,), generator=gen)
    r = torch.bernoulli(P[arms], generator=gen)
    m = r + torch.randn(10, generator=gen, dtype=torch.float64)
    psi = bandit_pool_gram(arms, PI)
    base, shifted = noisy_reward_moments(psi, r, m), noisy_reward_moments(psi, r, m + 3.5)
    for key in ("O2", "H2", "mu2"):
        assert shifted["model"][key] == pytest.approx(base["model"][key], rel=1e-9, abs=1e-12)
    assert shifted["bias2"] == pytest.approx(base["bias2"], rel=1e-9, abs=1e-12)
    assert noisy_reward_moments(psi, r, r + 2.0)["bias2"] == pytest.approx(0.0, abs=1e-12)


def test_grpo_against_the_reference_expands_as_the_docstring_says():
    nm = predicted_noisy_moments(REF, PSI2, 0.2, slope=0.7)
    G = 4
    c = (G - 1) / G
    want = (
        c * c * mse_from_moments(nm["model"], "rloo", G)
        + c * nm["bias2"]
        + (1 - c) * REF["mu2"]
        - c * (1 - c) * nm["model"]["mu2"]
    )
    assert mse_against_reference(nm, "grpo", G) == pytest.approx(want, rel=1e-12)
    assert estimator_spread(nm["model"], "grpo", G) == pytest.approx(c * c * mse_from_moments(nm["model"], "rloo", G))


# ---------------------------------------------------------------- statistical: Monte Carlo and pooled estimates


@pytest.mark.parametrize("slope,s", [(1.0, 1.0), (0.6, 0.5)])
@pytest.mark.parametrize("G", [2, 4])
def test_predicted_mse_matches_monte_carlo(G, slope, s):
    """Each estimator on r~ = slope r + e, formed directly, against the verifier's exact gradient."""
    arms, _, noisy = _noisy_draws(G, 100_000, slope, s, seed=10 * G + int(10 * slope))
    grad = bandit_true_gradient(P, THETA)
    J = float((PI * P).sum())
    pred = predicted_noisy_moments(REF, PSI2, s * s, slope)
    for est in NOISE_ESTIMATORS:
        err = ((bandit_estimates(arms, noisy, PI, slope * J, est) - grad) ** 2).sum(dim=1)  # [trials]
        mean, lo, hi = mean_ci(err)
        se = (hi - lo) / 3.92
        assert abs(mean - mse_against_reference(pred, est, G)) < 4 * se, (est, mean, se)
        if est == "rloo" and slope == 1.0:  # the noise over G, as for the oracle, is many standard errors off
            assert abs(mean - (mse_from_moments(REF, "rloo", G) + s * s * PSI2 / G)) > 20 * se


def test_pooled_noisy_moments_are_unbiased():
    """The mean over many bandit pools of each pooled estimate is the exact value; H2 gains s^2 E||psi||^2, not
    half of it."""
    slope, s, N, pools = 0.7, 0.8, 6, 4000
    arms, r, noisy = _noisy_draws(N, pools, slope, s, seed=3)
    got = [noisy_reward_moments(bandit_pool_gram(a, PI), x, y) for a, x, y in zip(arms, r, noisy)]
    exact = predicted_noisy_moments(REF, PSI2, s * s, slope)
    checks = {
        "model H2": ([g["model"]["H2"] for g in got], exact["model"]["H2"]),
        "model O2": ([g["model"]["O2"] for g in got], exact["model"]["O2"]),
        "model mu2": ([g["model"]["mu2"] for g in got], exact["model"]["mu2"]),
        "bias2": ([g["bias2"] for g in got], exact["bias2"]),
        "cross": ([g["cross"] for g in got], exact["cross"]),
        "psi2": ([g["psi2"] for g in got], PSI2),
    }
    for name, (values, want) in checks.items():
        mean, lo, hi = mean_ci(values)
        assert abs(mean - want) < 4 * (hi - lo) / 3.92, (name, mean, want)
    h2 = [g["model"]["H2"] for g in got]
    mean, lo, hi = mean_ci(h2)
    assert abs(mean - (slope**2 * REF["H2"] + s * s * PSI2 / 2)) > 10 * (hi - lo) / 3.92


# ---------------------------------------------------------------- fits and summaries


def test_affine_calibration_and_within_prompt_fits():
    m = torch.tensor([[0.0, 1.0, 2.0], [4.0, 5.0, 9.0]])
    a, b = affine_calibration(m, 2 * m - 1)
    assert (a, b) == (pytest.approx(2.0), pytest.approx(-1.0))
    assert affine_calibration(torch.ones(2, 3), m) == (0.0, pytest.approx(float(m.mean())))
    # rows [0, 1, 2] and [4, 5, 9]: squared deviations 2 and 14, over M (N - 1) = 4
    assert within_prompt_variance(m) == pytest.approx(16 / 4)
    k, s2 = within_prompt_slope(3 * m + torch.tensor([[1.0], [-7.0]]), m)  # each prompt its own intercept
    assert k == pytest.approx(3.0) and s2 == pytest.approx(0.0, abs=1e-12)
    k, s2 = within_prompt_slope(m, torch.ones(2, 3))
    assert math.isnan(k) and s2 == pytest.approx(4.0)


def test_agreement_by_hand():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    got = agreement(r, torch.tensor([0.9, 0.2, 0.4, 0.1]))
    assert got["accuracy"] == 0.75
    # x - mean = [0.5, -0.2, 0, -0.3], y - mean = [0.5, -0.5, 0.5, -0.5]
    assert got["pearson"] == pytest.approx(0.5 / math.sqrt(0.38 * 1.0))
    # passing rollouts score 0.9 and 0.4, failing 0.2 and 0.1: all four pairs ordered right
    assert got["auroc"] == 1.0
    assert agreement(r, torch.tensor([0.3, 0.3, 0.1, 0.2]))["auroc"] == pytest.approx((0.5 + 1 + 0 + 0) / 4)
    flat = agreement(torch.ones(4), torch.tensor([0.1, 0.2, 0.3, 0.4]))
    assert math.isnan(flat["pearson"]) and math.isnan(flat["auroc"])


def test_matching_group_size():
    target = mse_from_moments(REF, "rloo", 4)
    noisy = [predicted_noisy_moments(REF, PSI2, 0.5)]
    G = matching_group_size(noisy, "rloo", target)
    assert mse_against_reference(noisy[0], "rloo", G) <= target < mse_against_reference(noisy[0], "rloo", G - 1)
    assert matching_group_size([predicted_noisy_moments(REF, PSI2, 0.0)], "rloo", target) == 4
    assert matching_group_size([{**noisy[0], "bias2": target}], "rloo", target) is None
    assert matching_group_size(noisy, "rloo", target, g_max=G - 1) == math.inf


def test_best_scale_is_the_minimum_over_a_grid_and_the_cosine():
    nms = [predicted_noisy_moments(REF, PSI2, 0.3, slope=0.5), predicted_noisy_moments(REF, PSI2, 0.1, slope=2.0)]
    G = 4
    lam, best = best_scale(nms, "grpo", G)

    def scaled(nm, x):  # the moments of x r~
        model = {k: v * x * x for k, v in nm["model"].items()}
        cross = x * nm["cross"]
        return {**nm, "model": model, "cross": cross, "bias2": model["mu2"] - 2 * cross + nm["ref"]["mu2"]}

    grid = [i / 1000 for i in range(1, 3000)]
    mses = [sum(mse_against_reference(scaled(nm, x), "grpo", G) for nm in nms) / 2 for x in grid]
    assert best == pytest.approx(min(mses), rel=1e-5)
    assert lam == pytest.approx(grid[mses.index(min(mses))], abs=2e-3)
    # per-prompt slopes 0.5 and 2 turn the stacked gradient: (0.5 + 2) / sqrt((0.25 + 4) * 2)
    assert gradient_cosine(nms) == pytest.approx(2.5 / math.sqrt(8.5))
    same = [predicted_noisy_moments(REF, PSI2, s2, slope=0.5) for s2 in (0.3, 0.1)]
    assert gradient_cosine(same) == pytest.approx(1.0)  # noise does not turn the mean gradient
    assert gradient_cosine([predicted_noisy_moments(REF, PSI2, 0.3, slope=-1.0)]) == pytest.approx(-1.0)


# ---------------------------------------------------------------- the driver end to end


NOISY_REWARD = '''
import zlib
from grpolab.rewards.builtin import accuracy_reward


def noisy_accuracy(completions, records):
    """The accuracy plus noise that depends on the completion's text only (seeded by its CRC)."""
    import random
    return [a + random.Random(zlib.crc32(c.encode())).gauss(0, 0.5) for a, c in zip(accuracy_reward(completions, records), completions)]
'''


@pytest.mark.slow
def test_driver_end_to_end_on_the_builtin_model(tmp_path):
    (tmp_path / "noisy.py").write_text(NOISY_REWARD)
    out = tmp_path / "out"
    cmd = [
        sys.executable, str(ROOT / "benchmarks/reward_noise.py"), "--policy", "builtin", "--prompts", "3",
        "--pool", "4", "--max-new-tokens", "8", "--temperature", "1.0", "--group-sizes", "2", "4", "--bootstrap", "50",
        "--reward-fn", "grpolab.rewards.builtin:accuracy_reward", str(tmp_path / "noisy.py") + ":noisy_accuracy",
        "--threads", "1", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    report = json.loads((out / "reward_noise.json").read_text())
    assert report["verifier"] == "accuracy_reward" and list(report["models"]) == ["noisy_accuracy"]
    model = report["models"]["noisy_accuracy"]
    assert len(model["prompts"]) == 3 and math.isfinite(model["calibration"]["a"])
    assert {r["estimator"] for r in model["mse"]} == set(NOISE_ESTIMATORS)
    assert "| noisy_accuracy" in (out / "reward_noise.md").read_text()
    # the saved pool is analysed again without sampling, to the same report
    again = subprocess.run([*cmd, "--from-pool", str(out / "pool.pt")], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    assert json.loads((out / "reward_noise.json").read_text())["models"] == report["models"]


def _driver():
    import importlib.util

    spec = importlib.util.spec_from_file_location("reward_noise", ROOT / "benchmarks/reward_noise.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("reward_noise", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_driver_matched_group_sizes_agree_with_a_direct_search():
    """The driver's vectorised searches (resampled for their intervals) give the G a plain loop over G finds."""
    driver = _driver()
    nms = [predicted_noisy_moments(REF, PSI2, s2, slope=k) for s2, k in ((0.2, 0.6), (0.05, 0.9), (0.4, 0.5))]
    for est in NOISE_ESTIMATORS:
        got = driver.matched_g(nms, est, 4, reps=20, seed=0)
        assert got["G"] == matching_group_size(nms, est, got["target"])
        sf = driver.matched_g_scale_free(nms, est, 4, reps=20, seed=0)
        want = next(G for G in range(2, 1025) if best_scale(nms, est, G)[1] <= sf["target"])
        assert sf["G"] == want and sf["target"] == pytest.approx(
            best_scale([{**nm, "model": nm["ref"], "cross": nm["ref"]["mu2"]} for nm in nms], est, 4)[1]
        )
