"""Monte Carlo checks of the Foundations paper's closed forms: the Hoeffding table of App. A.2 and Thm 4.1."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import torch

from grpolab.config.train import ConfigError
from grpolab.probes.advantage_stats import advantage_stats


@dataclasses.dataclass
class HoeffdingConfig:
    """[Foundations, App. A.2]: P(|v_R - v| > eps) <= 2 exp(-2 R eps^2) for R Bernoulli(p) rewards, next to Monte Carlo."""

    p: float = 0.5
    """Success probability of the Bernoulli rewards."""
    group_sizes: tuple[int, ...] = (2, 4, 8, 16)
    """R values."""
    eps: tuple[float, ...] = (0.3, 0.2, 0.1)
    """Deviation thresholds."""
    trials: int = 200_000
    """Monte Carlo groups per R."""
    seed: int = 0
    """Seed."""
    json: bool = False
    """Print a JSON list of {R, eps, bound, mc, exact} records instead of a table."""


@dataclasses.dataclass
class AdvantagesConfig:
    """[Foundations, Thm 4.1] for Bernoulli(p) rewards: Var(A_i), Cov(A_i, A_j), epsilon-effective share vs Eq. 20."""

    R: int = 8
    """Group size."""
    p: float = 0.3
    """Success probability (sigma^2 = p (1 - p))."""
    eps: float = 0.2
    """Threshold of an epsilon-effective rollout, |A_i| > eps."""
    trials: int = 200_000
    """Monte Carlo groups."""
    seed: int = 0
    """Seed."""
    json: bool = False
    """Print JSON instead of a table."""


def _deviates(k: int, R: int, p: float, eps: float) -> bool:
    """|k/R - p| > eps, exactly, with p and eps read as the decimals they print as."""
    p_, eps_ = Fraction(repr(p)), Fraction(repr(eps))
    return abs(Fraction(k, R) - p_) > eps_


def hoeffding_rows(cfg: HoeffdingConfig) -> list[dict]:
    """One record per (R, eps): the bound, a Monte Carlo estimate and the exact binomial probability."""
    if not 0 <= cfg.p <= 1:
        raise ConfigError(f"--p must be in [0, 1], got {cfg.p}")
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = []
    for R in cfg.group_sizes:
        k = torch.binomial(torch.full((cfg.trials,), float(R)), torch.full((cfg.trials,), cfg.p), generator=gen).long()
        for eps in cfg.eps:
            # Decide |k/R - p| > eps in exact rational arithmetic on the decimal values the user
            # typed: at p=0.6, R=2, eps=0.1, k=1 sits exactly on the threshold, and float rounding
            # would call it a deviation or not at random. One table of outcomes serves both columns.
            deviates = torch.tensor([_deviates(j, R, cfg.p, eps) for j in range(R + 1)])  # [R+1]
            exact = sum(math.comb(R, j) * cfg.p**j * (1 - cfg.p) ** (R - j) for j in range(R + 1) if deviates[j])
            rows.append(
                {
                    "R": R,
                    "eps": eps,
                    "bound": 2 * math.exp(-2 * R * eps**2),
                    "mc": float(deviates[k].double().mean()),
                    "exact": exact,
                }
            )
    return rows


def advantages_check(cfg: AdvantagesConfig) -> dict:
    if cfg.R < 2:
        raise ConfigError(f"--R must be >= 2, got {cfg.R}")
    if not 0 <= cfg.p <= 1:
        raise ConfigError(f"--p must be in [0, 1], got {cfg.p}")
    gen = torch.Generator().manual_seed(cfg.seed)
    rewards = torch.bernoulli(torch.full((cfg.trials, cfg.R), cfg.p, dtype=torch.float64), generator=gen)  # [trials, R]
    stats = advantage_stats(rewards, eps=cfg.eps, sigma2=cfg.p * (1 - cfg.p))
    keys = ("var_emp", "var_theory", "cov_emp", "cov_theory", "eff_frac_emp", "eff_bound", "max_abs_group_sum")
    return {k: stats[k] for k in keys}


def format_hoeffding(rows: list[dict], cfg: HoeffdingConfig) -> str:
    """The App. A.2 table: per R and eps, the bound (marked vacuous when >= 1), Monte Carlo and exact."""
    lines = [
        f"P(|v_R - v| > eps) for R Bernoulli({cfg.p}) rewards: Hoeffding bound 2 exp(-2 R eps^2) / Monte Carlo ({cfg.trials} groups) / exact",
        f"{'R':>3} " + " ".join(f"{'eps=' + str(e):>26}" for e in cfg.eps),
    ]
    for R in cfg.group_sizes:
        cells = [r for r in rows if r["R"] == R]
        lines.append(
            f"{R:>3} "
            + " ".join(
                f"{c['bound']:>7.2f}{' (vacuous)' if c['bound'] >= 1 else '':<10} {c['mc']:.3f} {c['exact']:.3f}"
                for c in cells
            )
        )
    return "\n".join(lines)


def format_advantages(res: dict, cfg: AdvantagesConfig) -> str:
    """Thm 4.1 and Eq. 20, empirical next to theory."""
    return "\n".join(
        [
            f"R={cfg.R}, p={cfg.p}, eps={cfg.eps}, {cfg.trials} groups",
            f"  Var(A_i):          empirical {res['var_emp']:.5f}   theory (R-1)/R sigma^2 = {res['var_theory']:.5f}",
            f"  Cov(A_i, A_j):     empirical {res['cov_emp']:.5f}   theory -sigma^2/R      = {res['cov_theory']:.5f}",
            f"  P(|A_i| > eps):    empirical {res['eff_frac_emp']:.5f}   Chebyshev bound (Eq. 20) = {res['eff_bound']:.5f}",
            f"  max |sum_i A_i|:   {res['max_abs_group_sum']:.2e}",
        ]
    )
