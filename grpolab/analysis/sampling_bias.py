"""Bias and error of a step's gradient under --sampling fixed|filter|adaptive, on a bandit with exact answers.

The task: M prompts drawn uniformly, prompt m a two-armed softmax bandit with its own logits
theta_m (the policy pi_m = softmax(theta_m)) and Bernoulli arms. With uniform logits and arm
success probabilities (0, 2 J_m) (J_m <= 1/2) or (2 J_m - 1, 1), prompt m's pass rate is
exactly J_m, so the prompts cover pass rates chosen by ``--pass-rates``. The objective is
J = (1/M) sum_m J_m and its gradient is exact: block m is (1/M) pi_m (p_m - J_m).

A step runs the very rules the trainer runs (``grpolab.algo.group_budget``: ``next_round_size``,
``allocate_group_sizes``, ``prompt_weights``; ``grpolab.algo.advantages``): B prompts, groups of
rollouts, each group's estimate (1/n) sum_j A_j psi_j with psi = e_a - pi (the score of a
softmax), each kept prompt weighing 1/(kept groups). Over many independent steps the mean
estimate E[g] is compared with grad J:

- ``scale`` c_m = <E g_m, grad_m J> / ||grad_m J||^2 per prompt (with a 95% interval). With two
  arms, psi lives on one line, so E g_m = c_m grad_m J exactly and c_m is the whole story of
  prompt m: unbiased means c_m = 1 for every m; a common c != 1 only rescales the step
  (a learning-rate change); c_m differing across m turns the direction.
- ``rel_bias`` ||E g - grad J|| / ||grad J|| and ``cosine`` (E g, grad J), from the c_m.
- ``mse`` E||g - grad J||^2 (with a 95% interval) and the rollouts a step generated;
  ``mse_rescaled`` min_s E||s g - grad J||^2 = ||grad J||^2 - E<g, grad J>^2 / E||g||^2,
  the error left when the learning rate absorbs a common scale (``best_factor`` s).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from grpolab.algo.advantages import compute_advantages, ragged_advantages
from grpolab.algo.group_budget import allocate_group_sizes, next_round_size, prompt_weights
from grpolab.algo.groups import varies
from grpolab.common.stats import mean_ci


@dataclasses.dataclass(frozen=True)
class BanditStep:
    """One step's shape: B prompts, groups of G (the fixed budget B G), and the modes' knobs."""

    B: int = 8
    G: int = 8
    pilot_size: int = 4
    max_rounds: int = 3
    max_group_size: int = 0  # 0 = 4 G
    estimator: str = "rloo"


def bandit_prompts(pass_rates: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Arm success probabilities ``[M, 2]`` with pass rate J_m under uniform logits, and those logits ``[M, 2]``."""
    arms = np.array([[max(0.0, 2 * j - 1), min(1.0, 2 * j)] for j in pass_rates], dtype=np.float64)
    return arms, np.zeros_like(arms)


def exact_gradient(arms: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """grad J ``[M, K]``: block m is (1/M) pi_m (p_m - J_m)."""
    pi = np.exp(logits - logits.max(1, keepdims=True))
    pi /= pi.sum(1, keepdims=True)
    J = (pi * arms).sum(1, keepdims=True)
    return pi * (arms - J) / arms.shape[0]


def _draw(rng: np.random.Generator, arms: np.ndarray, pi: np.ndarray, m: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rollouts of prompt m: (arms chosen ``[n]``, rewards ``[n]``)."""
    a = rng.choice(arms.shape[1], size=n, p=pi[m])
    return a, (rng.random(n) < arms[m, a]).astype(np.float64)


def _group_estimate(a: np.ndarray, adv: np.ndarray, pi_m: np.ndarray) -> np.ndarray:
    """(1/n) sum_j A_j (e_{a_j} - pi_m) ``[K]``."""
    K = pi_m.shape[0]
    psi = np.eye(K)[a] - pi_m  # [n, K]
    return (adv[:, None] * psi).mean(0)


def simulate_step(
    mode: str, rng: np.random.Generator, arms: np.ndarray, logits: np.ndarray, cfg: BanditStep
) -> tuple[np.ndarray, int]:
    """One step's gradient estimate ``[M, K]`` and the rollouts it generated."""
    M, K = arms.shape
    pi = np.exp(logits - logits.max(1, keepdims=True))
    pi /= pi.sum(1, keepdims=True)
    B, G = cfg.B, cfg.G
    g = np.zeros((M, K))
    if mode == "adaptive":
        prompts = rng.integers(M, size=B)
        pilots = [_draw(rng, arms, pi, m, cfg.pilot_size) for m in prompts]
        sizes = allocate_group_sizes([r.tolist() for _, r in pilots], B * G, cfg.max_group_size or 4 * G)
        groups = []
        for (a0, r0), m, n in zip(pilots, prompts, sizes):
            a1, r1 = _draw(rng, arms, pi, m, n - cfg.pilot_size)
            groups.append((np.concatenate([a0, a1]), np.concatenate([r0, r1])))
        adv = ragged_advantages([torch.from_numpy(r) for _, r in groups], cfg.estimator).double().numpy()
        w = prompt_weights(sizes)  # N / (B n_b), N = B G: with the loss's 1/N, each rollout weighs 1 / (B n_b)
        start = 0
        for (a, _), m, n, wb in zip(groups, prompts, sizes, w):
            g[m] += wb * n / (B * G) * _group_estimate(a, adv[start : start + n], pi[m])  # = group estimate / B
            start += n
        return g, B * G
    kept, drawn, rounds, generated = [], 0, 0, 0
    while True:
        n = B if rounds == 0 else next_round_size(B, len(kept), drawn)
        if n == 0 or rounds == (cfg.max_rounds if mode == "filter" else 1):
            break
        prompts = rng.integers(M, size=n)
        draws = [_draw(rng, arms, pi, m, G) for m in prompts]
        generated += n * G
        rewards = torch.from_numpy(np.stack([r for _, r in draws]))  # [n, G]
        adv = compute_advantages(rewards, cfg.estimator).double().numpy()
        for i, m in enumerate(prompts):
            if mode == "fixed" or varies(draws[i][1].tolist()):
                kept.append((m, _group_estimate(draws[i][0], adv[i], pi[m])))
        drawn += n
        rounds += 1
    kept = kept[:B]
    for m, est in kept:
        g[m] += est / len(kept)  # the loss's mean over the kept groups' rollouts (all of size G)
    return g, generated


def measure(
    modes: tuple[str, ...], pass_rates: tuple[float, ...], cfg: BanditStep, trials: int, seed: int
) -> list[dict]:
    """Per mode: per-prompt scales c_m, relative bias, cosine, MSE (95% intervals) and rollouts per step."""
    arms, logits = bandit_prompts(pass_rates)
    grad = exact_gradient(arms, logits)  # [M, K]
    norm2 = (grad**2).sum(1)  # [M]
    out = []
    for mode in modes:
        rng = np.random.default_rng([seed, ("fixed", "filter", "adaptive").index(mode)])
        proj = np.zeros((trials, len(pass_rates)))
        err, dot, sq = np.zeros(trials), np.zeros(trials), np.zeros(trials)
        rollouts = np.zeros(trials)
        for t in range(trials):
            g, n = simulate_step(mode, rng, arms, logits, cfg)
            proj[t] = (g * grad).sum(1) / norm2  # [M]
            err[t] = ((g - grad) ** 2).sum()
            dot[t], sq[t] = (g * grad).sum(), (g * g).sum()
            rollouts[t] = n
        scales = [mean_ci(torch.from_numpy(proj[:, m])) for m in range(len(pass_rates))]
        c = np.array([s[0] for s in scales])
        eg2 = float((c**2 * norm2).sum())
        out.append(
            {
                "mode": mode,
                "B": cfg.B,
                "G": cfg.G,
                "estimator": cfg.estimator,
                "trials": trials,
                "rollouts_per_step": float(rollouts.mean()),
                "scale": [{"pass_rate": j, "c": s[0], "lo": s[1], "hi": s[2]} for j, s in zip(pass_rates, scales)],
                "rel_bias": math.sqrt(float(((c - 1) ** 2 * norm2).sum()) / float(norm2.sum())),
                "cosine": float((c * norm2).sum()) / math.sqrt(eg2 * float(norm2.sum())) if eg2 > 0 else 0.0,
                "mse": dict(zip(("mean", "lo", "hi"), mean_ci(torch.from_numpy(err)))),
                # min over a common factor s of E||s g - grad J||^2: the error left once the step length is tuned
                "mse_rescaled": float(norm2.sum()) - float(dot.mean()) ** 2 / float(sq.mean()),
                "best_factor": float(dot.mean() / sq.mean()),
            }
        )
    return out


def format_sampling_bias(records: list[dict]) -> str:
    rates = [s["pass_rate"] for s in records[0]["scale"]]
    head = f"{'mode':<9} {'rollouts':>8}  " + "  ".join(f"c(J={j:g})".rjust(20) for j in rates)
    lines = [head + f"  {'rel. bias':>9} {'cosine':>7}  {'MSE [95% CI]':>30}  {'rescaled':>9}"]
    for r in records:
        cells = "  ".join(f"{s['c']:.3f} [{s['lo']:.3f},{s['hi']:.3f}]".rjust(20) for s in r["scale"])
        m = r["mse"]
        lines.append(
            f"{r['mode']:<9} {r['rollouts_per_step']:>8.1f}  {cells}  {r['rel_bias']:>9.3f} {r['cosine']:>7.4f}  "
            f"{m['mean']:.3e} [{m['lo']:.3e}, {m['hi']:.3e}]  {r['mse_rescaled']:.3e}"
        )
    return "\n".join(lines)
