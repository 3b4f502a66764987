"""Estimator MSE in Gram space [U-statistic]: exact bandit answers, unbiased pooled moments, group size, CLI."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
import torch
from helpers.cli import run_cli

from grpolab.analysis.mse_cmd import MseConfig, run_bandit
from grpolab.probes.bandit import bandit_estimates, bandit_moments, bandit_pool_gram, bandit_true_gradient
from grpolab.probes.mse import (
    MSE_ESTIMATORS,
    derived_constants,
    groupsize_constants,
    mse_from_moments,
    optimal_group_size,
    predicted_mse,
    prompt_moments,
    rloo_weights,
    rows_mse,
)

P = torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)
THETA = torch.tensor([0.0, 0.5, -0.5], dtype=torch.float64)


def _outcome_sequences(p, pi, G):
    """Every sequence of G (arm, reward) outcomes of the bandit: arms ``[S, G]``, rewards ``[S, G]`` and each
    sequence's probability ``[S]`` (summing to 1)."""
    seqs = list(itertools.product([(a, r) for a in range(len(p)) for r in (0, 1)], repeat=G))
    arms = torch.tensor([[a for a, _ in s] for s in seqs])  # [S, G]
    rewards = torch.tensor([[float(r) for _, r in s] for s in seqs], dtype=torch.float64)
    prob = (pi[arms] * torch.where(rewards > 0, p[arms], 1 - p[arms])).prod(dim=1)  # [S]
    assert float(prob.sum()) == pytest.approx(1.0, abs=1e-12)
    return arms, rewards, prob


def _enumerated_mse(p, theta, estimator, G):
    """E||g - grad J||^2 by summing over every sequence of G (arm, reward) outcomes."""
    pi = torch.softmax(theta, 0)
    J = float((pi * p).sum())
    grad = bandit_true_gradient(p, theta)
    arms, rewards, prob = _outcome_sequences(p, pi, G)
    err = ((bandit_estimates(arms, rewards, pi, J, estimator) - grad) ** 2).sum(dim=1)
    return float((prob * err).sum())


# ---------------------------------------------------------------- the closed forms are exact


@pytest.mark.parametrize(
    "p,theta",
    [
        (P, THETA),
        (
            torch.tensor([0.9, 0.1, 0.4, 0.6], dtype=torch.float64),
            torch.tensor([1.0, -1.0, 0.2, 0.0], dtype=torch.float64),
        ),
    ],
)
@pytest.mark.parametrize("G", [2, 3])
@pytest.mark.parametrize("estimator", MSE_ESTIMATORS)
def test_closed_form_mse_equals_enumeration(p, theta, G, estimator):
    exact = mse_from_moments(bandit_moments(p, theta), estimator, G)
    assert exact == pytest.approx(_enumerated_mse(p, theta, estimator, G), rel=1e-10, abs=1e-14)


def test_bandit_acceptance_exact_inside_monte_carlo_ci():
    # The documented check (docs/u-statistic.md): every estimator and G in {2, 4, 8, 16}, 20,000 trials, seed 0.
    records = run_bandit(
        MseConfig(
            env="bandit",
            arm_probs=(0.2, 0.5, 0.8),
            logits=(0.0, 0.5, -0.5),
            group_sizes=(2, 4, 8, 16),
            trials=20_000,
            seed=0,
        )
    )
    assert len(records) == 16
    outside = [r for r in records if not r["ci_low"] <= r["mse_exact"] <= r["ci_high"]]
    assert not outside, outside


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_bandit_monte_carlo_agrees_within_4_standard_errors(seed):
    records = run_bandit(
        MseConfig(
            env="bandit", arm_probs=(0.7, 0.3), logits=(0.3, -0.2), group_sizes=(2, 5, 12), trials=20_000, seed=seed
        )
    )
    for r in records:
        se = (r["ci_high"] - r["ci_low"]) / (2 * 1.96)
        assert abs(r["mse_mc"] - r["mse_exact"]) < 4 * se, r


def test_a_wrong_formula_would_fail_the_monte_carlo_check():
    # Dropping the residual term of rloo (treating it as the oracle) is far outside the CI at G = 2.
    records = run_bandit(MseConfig(env="bandit", group_sizes=(2,), trials=20_000, seed=0))
    rloo = next(r for r in records if r["estimator"] == "rloo")
    oracle_formula = mse_from_moments(bandit_moments(P, THETA), "oracle", 2)
    assert not rloo["ci_low"] <= oracle_formula <= rloo["ci_high"]


def test_oracle_property_and_grpo_shrinkage():
    m = bandit_moments(P, THETA)
    gaps = [mse_from_moments(m, "rloo", G) / mse_from_moments(m, "oracle", G) - 1 for G in (2, 4, 8, 16, 64, 256)]
    assert all(a > b > 0 for a, b in zip(gaps, gaps[1:]))  # rloo's excess over the oracle shrinks with G
    assert gaps[-1] < 0.01
    for G in (2, 4, 8):
        c = (G - 1) / G
        assert mse_from_moments(m, "grpo", G) == pytest.approx(
            c * c * mse_from_moments(m, "rloo", G) + (1 - c) ** 2 * m["mu2"]
        )
        assert mse_from_moments(m, "vanilla", G) == pytest.approx((m["A2"] - m["mu2"]) / G)


@pytest.mark.parametrize("estimator,G", [("rloo", 1), ("grpo", 1), ("oracle", 0), ("nope", 4)])
def test_mse_from_moments_rejects_bad_arguments(estimator, G):
    with pytest.raises(ValueError):
        mse_from_moments(bandit_moments(P, THETA), estimator, G)


# ---------------------------------------------------------------- pooled moments are unbiased


@pytest.mark.slow
def test_pool_moments_are_unbiased_on_the_bandit():
    pi = torch.softmax(THETA, 0)
    exact = bandit_moments(P, THETA)
    gen = torch.Generator().manual_seed(7)
    samples = {k: [] for k in exact}
    for _ in range(4000):
        arms = torch.multinomial(pi, 5, replacement=True, generator=gen)  # N = 5: small pools, where bias would show
        rewards = torch.bernoulli(P[arms], generator=gen)
        for k, v in prompt_moments(bandit_pool_gram(arms, pi), rewards).items():
            samples[k].append(v)
    for k, vals in samples.items():
        v = torch.tensor(vals)
        se = float(v.std()) / math.sqrt(len(vals))
        assert abs(float(v.mean()) - exact[k]) < 4 * se, (k, float(v.mean()), exact[k], se)


LENGTHS = torch.tensor([4.0, 1.0, 16.0], dtype=torch.float64)  # per-arm lengths: phi = psi / |o| has E phi != 0


def _phi(arms, pi):
    """Length-normalised scores (e_a - pi) / L_a: the rows of a seq-mean aggregation, not scores."""
    return (torch.nn.functional.one_hot(arms, 3).double() - pi) / LENGTHS[arms][..., None]


def _enumerated_rows_mse(G):
    """E||g - mu||^2 of the grpo, rloo and oracle estimators built on _phi, mu = E[(r - v) phi], summed over every
    sequence of G (arm, reward) outcomes."""
    pi = torch.softmax(THETA, 0)
    v = float((pi * P).sum())
    mu = (pi * (P - v))[:, None] * _phi(torch.arange(3), pi)  # [K, K] per arm: E[(r - v) | a] phi(a) pi_a
    mu = mu.sum(dim=0)
    arms, r, prob = _outcome_sequences(P, pi, G)
    phi = _phi(arms, pi)  # [S, G, K]
    adv = {
        "grpo": r - r.mean(dim=1, keepdim=True),
        "rloo": r - (r.sum(dim=1, keepdim=True) - r) / (G - 1),
        "oracle": r - v,
    }
    c = (G - 1) / G
    out = {}
    for name, a in adv.items():
        g = (a[..., None] * phi).mean(dim=1)  # [S, K]
        assert torch.allclose((prob[:, None] * g).sum(0), (c if name == "grpo" else 1.0) * mu)  # the stated means
        out[name] = float((prob * ((g - mu) ** 2).sum(dim=1)).sum())
    out["mu2"] = float((mu * mu).sum())
    return out


@pytest.mark.slow
def test_rows_mse_is_unbiased_for_rows_that_are_not_scores():
    """rows_mse over small pools averages to the enumerated MSE of length-normalised rows (E phi != 0), where the
    score-function moments of prompt_moments are biased (the check would catch a formula that assumed E phi = 0)."""
    G, N = 3, 6
    exact = _enumerated_rows_mse(G)
    pi = torch.softmax(THETA, 0)
    gen = torch.Generator().manual_seed(11)
    got, assuming_scores = {k: [] for k in exact}, []
    for _ in range(3000):
        arms = torch.multinomial(pi, N, replacement=True, generator=gen)
        rewards = torch.bernoulli(P[arms], generator=gen)
        phi = _phi(arms, pi)
        for k, val in rows_mse(phi @ phi.T, rewards, G).items():
            got[k].append(val)
        assuming_scores.append(mse_from_moments(prompt_moments(phi @ phi.T, rewards), "grpo", G))
    for k, vals in got.items():
        v = torch.tensor(vals)
        se = float(v.std()) / math.sqrt(len(vals))
        assert abs(float(v.mean()) - exact[k]) < 4 * se, (k, float(v.mean()), exact[k], se)
    wrong = torch.tensor(assuming_scores)
    assert abs(float(wrong.mean()) - exact["grpo"]) > 6 * float(wrong.std()) / math.sqrt(len(wrong))


def test_rows_mse_on_scores_agrees_with_the_closed_form():
    """For true scores (E psi = 0) both pooled estimates are unbiased for the same MSE: over many bandit pools their
    means agree with the closed form."""
    pi = torch.softmax(THETA, 0)
    exact = {e: mse_from_moments(bandit_moments(P, THETA), e, 4) for e in ("grpo", "rloo", "oracle")}
    gen = torch.Generator().manual_seed(3)
    got = {e: [] for e in exact}
    for _ in range(1500):
        arms = torch.multinomial(pi, 8, replacement=True, generator=gen)
        rewards = torch.bernoulli(P[arms], generator=gen)
        res = rows_mse(bandit_pool_gram(arms, pi), rewards, 4)
        for e in exact:
            got[e].append(res[e])
    for e, vals in got.items():
        v = torch.tensor(vals)
        assert abs(float(v.mean()) - exact[e]) < 4 * float(v.std()) / math.sqrt(len(vals)), e


def test_rows_mse_draws_subsets_when_there_are_too_many():
    """Past max_subsets the subsets are drawn (seeded): close to the full enumeration, and reproducible."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    r = torch.bernoulli(torch.full((12,), 0.5, dtype=torch.float64), generator=gen)
    full = rows_mse(x @ x.T, r, 6)  # C(12, 6) = 924 subsets
    drawn = rows_mse(x @ x.T, r, 6, max_subsets=400, seed=1)
    assert drawn == rows_mse(x @ x.T, r, 6, max_subsets=400, seed=1)
    assert drawn["oracle"] == full["oracle"] and drawn["mu2"] == full["mu2"]
    assert drawn["grpo"] == pytest.approx(full["grpo"], rel=0.1) and drawn["grpo"] != full["grpo"]
    with pytest.raises(ValueError, match="4 to 48"):
        rows_mse(x[:3] @ x[:3].T, r[:3], 2)
    with pytest.raises(ValueError, match="G must be"):
        rows_mse(x @ x.T, r, 1)


def test_pool_gram_matches_explicit_scores():
    pi = torch.softmax(THETA, 0)
    arms = torch.tensor([0, 2, 2, 1, 0])
    psi = torch.nn.functional.one_hot(arms, 3).double() - pi
    assert torch.allclose(bandit_pool_gram(arms, pi), psi @ psi.T)


def test_prompt_moments_needs_three_rollouts():
    with pytest.raises(ValueError, match="N >= 3"):
        prompt_moments(torch.eye(2), torch.tensor([0.0, 1.0]))


def test_rloo_weights_give_the_leave_one_out_estimate():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    a = rloo_weights(r)
    expected = torch.tensor([(r[i] - (r.sum() - r[i]) / 4) / 5 for i in range(5)], dtype=torch.float64)
    assert torch.allclose(a, expected)
    assert float(a.sum()) == pytest.approx(0.0, abs=1e-12)


# ---------------------------------------------------------------- group size under a budget


def _prompt_population(n, gen):
    """Contextual bandit: one shared softmax policy, per-prompt arm probabilities around P."""
    return P + (torch.rand(n, 3, generator=gen, dtype=torch.float64) - 0.5) * 0.3


@pytest.mark.slow
def test_groupsize_constants_and_prediction_match_a_minibatch_simulation():
    gen = torch.Generator().manual_seed(11)
    pi = torch.softmax(THETA, 0)
    # exact per-prompt quantities over a large sample of the prompt distribution
    big = _prompt_population(20_000, gen)
    mus = torch.stack([bandit_true_gradient(p, THETA) for p in big])  # [n, K]
    grad = mus.mean(0)
    exact = [derived_constants(bandit_moments(p, THETA)) for p in big[:4000]]
    true_c = {
        "sigma_prompt": float(((mus - grad) ** 2).sum(1).mean()),
        "sigma_oracle": sum(c["sigma_oracle"] for c in exact) / len(exact),
        "tau2": sum(c["tau2"] for c in exact) / len(exact),
    }

    # (1) the pooled estimates of the three constants, from M prompts x N rollouts, repeated:
    # sigma_P^2 is small next to the per-rollout noise, so one pool pins it down only loosely;
    # the mean over repeats must sit on the truth (unbiasedness), within 4 standard errors.
    M, N, reps = 200, 6, 30
    runs = []
    for _ in range(reps):
        moments, vecs = [], []
        for p in _prompt_population(M, gen):
            arms = torch.multinomial(pi, N, replacement=True, generator=gen)
            rewards = torch.bernoulli(p[arms], generator=gen)
            moments.append(prompt_moments(bandit_pool_gram(arms, pi), rewards))
            psi = torch.nn.functional.one_hot(arms, 3).double() - pi
            vecs.append(rloo_weights(rewards) @ psi)
        V = torch.stack(vecs)
        runs.append(groupsize_constants(moments, V @ V.T))
    truth = {**true_c, "grad_norm_sq": float(grad @ grad)}
    for k, want in truth.items():
        v = torch.tensor([r[k] for r in runs])
        se = float(v.std()) / math.sqrt(reps)
        assert abs(float(v.mean()) - want) < 4 * se + 2e-3 * abs(want), (k, float(v.mean()), want, se)

    # (2) Prop. 3 with the exact constants against a direct simulation of the minibatch rloo estimator
    budget, trials = 16, 6000
    for G in (2, 4, 8):
        B = budget // G
        p = _prompt_population(trials * B, gen).view(trials, B, 3)
        arms = torch.multinomial(pi.expand(trials * B, -1), G, replacement=True, generator=gen).view(trials, B, G)
        rewards = torch.bernoulli(torch.gather(p, 2, arms), generator=gen)
        J = float((pi * p.mean((0, 1))).sum())  # unused by rloo
        g = bandit_estimates(arms.view(-1, G), rewards.view(-1, G), pi, J, "rloo").view(trials, B, 3).mean(1)
        err = ((g - grad) ** 2).sum(1)
        se = float(err.std()) / math.sqrt(trials)
        assert abs(float(err.mean()) - predicted_mse(true_c, G, budget)) < 4 * se + 1e-4, G


def test_optimal_group_size_is_the_argmin_and_budget_free():
    c = {"sigma_prompt": 0.02, "sigma_oracle": 1.0, "tau2": 0.9}
    g_star = optimal_group_size(c)
    assert g_star == pytest.approx(1 + math.sqrt(2 * 0.9 / 0.02))
    for budget in (64, 256, 4096):
        grid = [2 + i * 0.01 for i in range(5000)]
        best = min(grid, key=lambda G: predicted_mse(c, G, budget))
        assert best == pytest.approx(g_star, abs=0.02)
    assert optimal_group_size({**c, "sigma_prompt": 0.0}) == math.inf
    with pytest.raises(ValueError):
        predicted_mse(c, 1, 64)


# ---------------------------------------------------------------- the LM pool


def _sampler(policy, max_new_tokens: int, format_weight: float = 0.1):
    """The probes' sampler on ``policy`` with the built-in reward (accuracy + format_weight * format)."""
    from grpolab.analysis.pool import ProbeSampler
    from grpolab.rewards.builtin import default_reward_fns
    from grpolab.rewards.rewarder import Rewarder
    from grpolab.rollout.engine import EngineSpec, HFEngine, SamplingSettings
    from grpolab.rollout.service import RolloutService

    engine = HFEngine(policy.model, EngineSpec(policy.eos_id, policy.pad_id))
    reward = Rewarder(default_reward_fns(format_weight), max_new_tokens)
    return ProbeSampler(RolloutService(engine, policy, reward), SamplingSettings(max_new_tokens, 1.0))


def test_lm_pool_cross_diagonal_is_the_quadratic_form(tiny_model, char_tokenizer):
    from grpolab.analysis.pool import collect_pool
    from grpolab.common import streams
    from grpolab.data.arithmetic import probe_set
    from grpolab.models.policy import Policy
    from grpolab.probes.gram import score_gram

    policy = Policy(tiny_model, char_tokenizer, "tiny")
    for p in tiny_model.parameters():  # the session's model: an earlier test in this process may have left grads
        p.grad = None
    records = probe_set(500)[:3]
    sampler = _sampler(policy, max_new_tokens=8)
    pool = collect_pool(policy, records, 5, sampler, seed=3, progress=False)
    assert len(pool.moments) == 3 and pool.cross.shape == (3, 3)
    assert torch.allclose(pool.cross, pool.cross.T)
    # the explicit vector mu_hat(x) and the Gram quadratic form a^T Psi a agree
    for k, rec in enumerate(records):
        batch, rewards, _ = sampler(rec, 5, (streams.POOL, 3, k))
        psi = score_gram(tiny_model, batch, batch.completion_mask.double())
        a = rloo_weights(rewards)
        assert float(pool.cross[k, k]) == pytest.approx(float(a @ psi @ a), rel=1e-4, abs=1e-9)
        assert pool.moments[k] == pytest.approx(prompt_moments(psi, rewards), rel=1e-4, abs=1e-9)
    assert all(p.grad is None for p in tiny_model.parameters())


@pytest.mark.slow
def test_lm_pool_sketched_cross_products_are_close_to_exact():
    from grpolab.analysis.pool import collect_pool
    from grpolab.data.arithmetic import probe_set
    from grpolab.models.policy import load_policy

    policy = load_policy("builtin")  # the warm start: rewards with variance, so nonzero leave-one-out vectors
    records = probe_set(500)[:4]
    kw = dict(seed=1, progress=False)
    sampler = _sampler(policy, max_new_tokens=48)
    exact = collect_pool(policy, records, 6, sampler, **kw, sketch_dim=0)
    assert (exact.cross.diagonal() > 0).sum() >= 2
    k = 2**14
    sketched = collect_pool(policy, records, 6, sampler, **kw, sketch_dim=k)
    assert sketched.moments == exact.moments  # per-prompt moments never use the sketch
    norms = exact.cross.diagonal().clamp_min(0).sqrt()
    bound = 4 * math.sqrt(2 / k) * torch.outer(norms, norms)  # 4 standard deviations of a CountSketch entry
    err = (sketched.cross - exact.cross).abs()
    assert (err <= bound + 1e-12).all(), (err / bound).max()
    assert err.max() > 0  # it did sketch
    other = collect_pool(policy, records, 6, sampler, **kw, sketch_dim=8)
    assert not torch.allclose(other.cross, exact.cross, rtol=1e-3)  # a tiny sketch is visibly noisy: the test can fail


# ---------------------------------------------------------------- CLI


@pytest.mark.slow
def test_cli_mse_bandit_writes_the_records(tmp_path):
    res = run_cli(
        [
            "mse",
            "--env",
            "bandit",
            "--arm-probs",
            "0.2,0.5,0.8",
            "--logits",
            "0,0.5,-0.5",
            "--group-sizes",
            "2,4",
            "--trials",
            "2000",
            "--seed",
            "0",
            "--json",
            "b.json",
        ],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    records = json.loads((tmp_path / "b.json").read_text())
    assert {(r["estimator"], r["G"]) for r in records} == {(e, G) for e in MSE_ESTIMATORS for G in (2, 4)}
    assert all(set(r) == {"estimator", "G", "mse_mc", "ci_low", "ci_high", "mse_exact"} for r in records)
    assert "rloo" in res.stdout and "inside" in res.stdout


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--env", "bandit", "--arm-probs", "0.2,0.5", "--logits", "0,0,0"], "--arm-probs"),
        (["--pool", "2"], "--pool"),
        (["--env", "nope"], "--env"),
    ],
)
@pytest.mark.slow
def test_cli_mse_bad_config_is_a_one_line_error(tmp_path, args, flag):
    res = run_cli(["mse", *args], tmp_path)
    assert res.returncode == 2 and flag in res.stderr and "Traceback" not in res.stderr, res.stderr


@pytest.mark.slow
def test_cli_mse_and_groupsize_on_the_builtin_policy(tmp_path):
    res = run_cli(
        [
            "mse",
            "--policy",
            "builtin",
            "--prompts",
            "3",
            "--pool",
            "4",
            "--group-sizes",
            "2,8",
            "--max-new-tokens",
            "24",
            "--out",
            "m",
            "--no-progress",
        ],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "m" / "mse.json").read_text())
    (entry,) = report["policies"]
    assert {(r["estimator"], r["G"]) for r in entry["results"]} == {(e, G) for e in MSE_ESTIMATORS for G in (2, 8)}
    for r in entry["results"]:
        assert math.isfinite(r["mse"]) and r["ci_low"] <= r["mse"] <= r["ci_high"]
    assert (tmp_path / "m" / "mse.png").stat().st_size > 10_000

    res = run_cli(
        [
            "groupsize",
            "--policy",
            "builtin",
            "--prompts",
            "4",
            "--pool",
            "4",
            "--budget",
            "16",
            "--bootstrap",
            "50",
            "--max-new-tokens",
            "24",
            "--out",
            "g",
            "--no-progress",
        ],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    gs = json.loads((tmp_path / "g" / "groupsize.json").read_text())
    assert [c["G"] for c in gs["curve"]] == [2, 4, 8, 16]
    assert set(gs["constants"]) == {"sigma_prompt", "sigma_oracle", "tau2", "grad_norm_sq"}
    assert "G*" in res.stdout and (tmp_path / "g" / "groupsize.png").is_file()


@pytest.mark.slow
def test_sweep_validates_and_runs_end_to_end(tmp_path):
    from grpolab.analysis.sweep import SweepConfig, mean_ci_t, run_sweep
    from grpolab.config.train import ConfigError

    with pytest.raises(ConfigError, match="divide"):
        SweepConfig(budget=64, group_sizes=(3,)).validate()
    m, lo, hi = mean_ci_t([0.2, 0.4, 0.3])
    assert m == pytest.approx(0.3) and hi - m == pytest.approx(4.303 * 0.1 / math.sqrt(3))

    cfg = SweepConfig(
        budget=4,
        group_sizes=(2, 4),
        seeds=1,
        steps=1,
        jobs=1,
        eval_questions=8,
        predict=False,
        out=str(tmp_path / "sw"),
        progress=False,
    )
    # G = 2 alone with --jobs 1 (in this process), then both with --jobs 2: only G = 4 is left, run in a worker process
    first = run_sweep(dataclasses.replace(cfg, group_sizes=(2,)), log=lambda *a: None)
    report = run_sweep(dataclasses.replace(cfg, jobs=2), log=lambda *a: None)
    assert [r for r in report["runs"] if r["G"] == 2] == first["runs"]
    assert [(t["G"], t["B"]) for t in report["table"]] == [(2, 2), (4, 1)]
    assert {(r["G"], r["seed"]) for r in report["runs"]} == {(2, 0), (4, 0)}
    assert (tmp_path / "sw" / "sweep.png").is_file()
    # a finished sweep is not run again
    again = run_sweep(cfg, log=lambda *a: None)
    assert again["runs"] == report["runs"] and again["wall_s"] < 1.0


@pytest.mark.slow
def test_groupsize_step_picks_a_checkpoint_of_a_run(tmp_path):
    from grpolab.analysis.mse_cmd import GroupsizeConfig, run_groupsize
    from grpolab.config.train import TrainConfig
    from grpolab.training.recipe import train

    run = tmp_path / "run"
    train(
        TrainConfig(
            out=str(run),
            steps=1,
            save_every=1,
            prompts_per_step=4,
            group_size=8,
            eval_questions=4,
            eval_samples=1,
            lr=1e-3,
            warmup_steps=0,
            progress=False,
        ),
        log=lambda *a, **k: None,
    )
    kw = dict(prompts=3, pool=4, budget=8, bootstrap=20, max_new_tokens=16, progress=False)
    consts = {}
    for name, policy, step in (("builtin", "builtin", None), ("start", str(run), 0), ("newest", str(run), None)):
        report = run_groupsize(
            GroupsizeConfig(policy=policy, step=step, out=str(tmp_path / name), **kw), log=lambda *a: None
        )
        consts[name] = report["constants"]
    assert consts["start"] == consts["builtin"]  # step 0 is the run's starting model, on the run's (here: default) task
    assert consts["newest"] != consts["start"]  # step 1's weights moved
    with pytest.raises(FileNotFoundError, match="--step 5"):
        run_groupsize(GroupsizeConfig(policy=str(run), step=5, out=str(tmp_path / "x"), **kw), log=lambda *a: None)
