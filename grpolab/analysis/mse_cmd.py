"""``grpolab mse`` and ``grpolab groupsize``: estimator MSE and the optimal group size [U-statistic]."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
from pathlib import Path

import torch

from grpolab.algo.group_budget import SAMPLING_MODES
from grpolab.analysis.config import ProbeConfig
from grpolab.analysis.pool import collect_pool, probe_sampler
from grpolab.analysis.sampling_bias import BanditStep, measure
from grpolab.common import distributed
from grpolab.common.errors import ConfigError
from grpolab.common.given import NOTHING, Given
from grpolab.common.rng import set_threads
from grpolab.common.stats import percentile_interval
from grpolab.config import fields
from grpolab.eval.runs import load_task_policy, probe_task, resolve_target
from grpolab.probes.bandit import bandit_moments, bandit_mse_mc
from grpolab.probes.mse import (
    MSE_ESTIMATORS,
    groupsize_constants,
    mse_from_moments,
    mse_table,
    optimal_group_size,
    predicted_mse,
)


@dataclasses.dataclass(frozen=True)
class BanditSection:
    """--env bandit: the exact check on a softmax bandit, and the --sampling modes compared on one."""

    arm_probs: tuple[float, ...] = (0.2, 0.5, 0.8)
    """Bandit: success probability of each arm."""
    logits: tuple[float, ...] = (0.0, 0.5, -0.5)
    """Bandit: the softmax policy's logits, one per arm."""
    trials: int = 20_000
    """Bandit: Monte Carlo trials per G (per mode with --sampling)."""
    sampling: tuple[str, ...] = ()
    """Bandit: instead of MSE against G, compare one step's gradient under these --sampling modes of training (fixed,
    filter, adaptive) on prompts of --pass-rates: per-prompt bias scale c (1 = unbiased), relative bias, cosine to
    the true gradient, MSE, rollouts per step (grpolab.analysis.sampling_bias)."""
    pass_rates: tuple[float, ...] = (0.05, 0.2, 0.5, 0.8, 0.95)
    """Bandit --sampling: the prompts' pass rates (each a two-armed bandit; prompts drawn uniformly)."""
    prompts_per_step: int = 8
    """Bandit --sampling: B, prompts per step; a step's budget is B * G for each G of --group-sizes."""
    pilot_size: int = 4
    """Bandit --sampling adaptive: pilot rollouts per prompt (G <= pilot size: adaptive is skipped at that G)."""
    max_sampling_rounds: int = 3
    """Bandit --sampling filter: most rounds of prompt draws per step."""
    estimator: str = "rloo"
    """Bandit --sampling: the advantage estimator (rloo, grpo, grpo_std)."""
    json: str = ""
    """Bandit: also write the records to this JSON file."""


@fields.sectioned
class MseConfig(ProbeConfig):
    """MSE of the vanilla, grpo, rloo and oracle gradient estimators against G [U-statistic, Figure 4].

    With --env lm (default): for each --policy, sample --pool rollouts for each of --prompts
    probe questions, and estimate every estimator's MSE at every G from their score Gram
    matrices, without bias and with no further backward passes. With --env bandit: a softmax
    bandit whose exact MSEs are known, next to Monte Carlo.

    The token-masking options of training (--mask-truncated, --top-entropy-quantile) are not applied: the MSE
    decomposition needs psi to be a score (mean 0), which a masked psi is not; `grpolab rank` measures the masked
    gradient.
    """

    policy: tuple[str, ...] = ("builtin",)
    """Policies to measure: 'builtin', smollm2-135m-instruct, a model directory, a run directory (its newest checkpoint)
    or a run's checkpoint directory. Repeat the flag for several; all answer the questions of the first one's task."""
    env: str = "lm"
    """'lm' (a policy on the built-in task) or 'bandit' (the exact check)."""
    group_sizes: tuple[int, ...] = (2, 4, 8, 16, 32)
    """Group sizes G. Any G works whatever --pool: the MSE is a closed form in four pooled moments."""
    prompts: int = 32
    """Probe questions (the first M of the 500-question set of [U-statistic, Sec. 5.1])."""
    pool: int = 16
    """Rollouts per prompt in the pool (>= 3); more gives tighter intervals, not different answers."""
    out: str = "runs/mse"
    """Output directory (mse.json, mse.png)."""
    sketch_dim: int | None = None
    """Cross-prompt gradient products from a k-dimensional CountSketch (unbiased): None = only when the M gradient
    vectors would exceed 1 GB (a real model), 0 = always exact, k > 0 = always sketched."""
    bandit: BanditSection = BanditSection()

    def validate(self) -> None:
        if self.env not in ("lm", "bandit"):
            raise ConfigError(f"--env must be 'lm' or 'bandit', got {self.env!r}")
        if not self.group_sizes or min(self.group_sizes) < 1:
            raise ConfigError(f"--group-sizes must be >= 1, got {self.group_sizes}")
        if self.env == "bandit":
            if len(self.bandit.arm_probs) != len(self.bandit.logits) or len(self.bandit.arm_probs) < 2:
                raise ConfigError(
                    f"--arm-probs and --logits need the same number (>= 2) of arms, got {len(self.bandit.arm_probs)} and {len(self.bandit.logits)}"
                )
            if not all(0 <= p <= 1 for p in self.bandit.arm_probs):
                raise ConfigError(f"--arm-probs must lie in [0, 1], got {self.bandit.arm_probs}")
            if self.bandit.trials < 2:
                raise ConfigError(f"--trials must be >= 2, got {self.bandit.trials}")
            unknown = set(self.bandit.sampling) - set(SAMPLING_MODES)
            if unknown:
                raise ConfigError(f"--sampling: unknown mode(s) {sorted(unknown)}; choose from {SAMPLING_MODES}")
            if self.bandit.sampling:
                if not self.bandit.pass_rates or not all(0 <= j <= 1 for j in self.bandit.pass_rates):
                    raise ConfigError(f"--pass-rates must be non-empty and lie in [0, 1], got {self.bandit.pass_rates}")
                if (
                    min(self.group_sizes) < 2
                    or self.bandit.prompts_per_step < 1
                    or self.bandit.pilot_size < 2
                    or self.bandit.max_sampling_rounds < 1
                ):
                    raise ConfigError(
                        "--sampling needs --group-sizes >= 2, --prompts-per-step >= 1, --pilot-size >= 2 "
                        "and --max-sampling-rounds >= 1"
                    )
                if self.bandit.estimator not in ("rloo", "grpo", "grpo_std"):
                    raise ConfigError(
                        f"--estimator must be rloo, grpo or grpo_std (a group baseline), got {self.bandit.estimator!r}"
                    )
        else:
            if self.pool < 3:
                raise ConfigError(f"--pool must be >= 3 rollouts per prompt, got {self.pool}")
            if self.prompts < 2:
                raise ConfigError(f"--prompts must be >= 2, got {self.prompts}")


def run_bandit(cfg: MseConfig) -> list[dict]:
    """Per estimator and G: Monte Carlo MSE with its 95% CI next to the exact MSE."""
    p = torch.tensor(cfg.bandit.arm_probs, dtype=torch.float64)
    th = torch.tensor(cfg.bandit.logits, dtype=torch.float64)
    m = bandit_moments(p, th)
    records = []
    for G in cfg.group_sizes:
        mc = bandit_mse_mc(p, th, G, cfg.bandit.trials, seed=cfg.seed + G)
        for est, (mean, lo, hi) in mc.items():
            records.append(
                {
                    "estimator": est,
                    "G": G,
                    "mse_mc": mean,
                    "ci_low": lo,
                    "ci_high": hi,
                    "mse_exact": mse_from_moments(m, est, G),
                }
            )
    records.sort(key=lambda r: (MSE_ESTIMATORS.index(r["estimator"]), r["G"]))
    if cfg.bandit.json:
        Path(cfg.bandit.json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.bandit.json).write_text(json.dumps(records, indent=2))
    return records


def run_sampling_bias(cfg: MseConfig) -> list[dict]:
    """The bandit comparison of --sampling modes, for each G of --group-sizes (adaptive only where G > pilot)."""
    records = []
    for G in cfg.group_sizes:
        modes = tuple(m for m in cfg.bandit.sampling if m != "adaptive" or G > cfg.bandit.pilot_size)
        step = BanditStep(
            B=cfg.bandit.prompts_per_step,
            G=G,
            pilot_size=cfg.bandit.pilot_size,
            max_rounds=cfg.bandit.max_sampling_rounds,
            estimator=cfg.bandit.estimator,
        )
        records += measure(modes, cfg.bandit.pass_rates, step, cfg.bandit.trials, seed=cfg.seed + G)
    if cfg.bandit.json:
        Path(cfg.bandit.json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.bandit.json).write_text(json.dumps(records, indent=2))
    return records


def format_bandit(records: list[dict]) -> str:
    lines = [f"{'estimator':<9} {'G':>3} {'exact':>10} {'Monte Carlo [95% CI]':>34}  inside"]
    for r in records:
        inside = r["ci_low"] <= r["mse_exact"] <= r["ci_high"]
        lines.append(
            f"{r['estimator']:<9} {r['G']:>3} {r['mse_exact']:>10.6f} {r['mse_mc']:>10.6f} "
            f"[{r['ci_low']:.6f}, {r['ci_high']:.6f}]  {'yes' if inside else 'NO'}"
        )
    return "\n".join(lines)


def run_mse(cfg: MseConfig, log=print, given: Given = NOTHING) -> dict:
    """The Figure 4 analogue over the given policies; writes mse.json and mse.png."""
    set_threads(cfg.threads)
    world = distributed.init()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    # Every policy answers the same questions: those of the first one's task (its run's, or the built-in task).
    targets = [resolve_target(spec) for spec in cfg.policy]
    task, records, sampler = probe_task(targets[0], cfg, given)
    cfg = task.fill(cfg)  # what was measured with: the run's sampling and reward options where not given
    report = {"config": fields.to_flat(cfg), "policies": []}
    for spec, target in zip(cfg.policy, targets):
        policy = load_task_policy(target, task, sampler=sampler, given=given)
        pool = _pool(cfg, task, policy, records, world, log, given, label=f"pool {spec}")
        entry = {
            "policy": spec,
            "reward_mean": statistics.fmean(pool.reward_mean),
            "frac_zero_var": sum(s == 0 for s in pool.reward_std) / len(pool.reward_std),
            "results": mse_table(pool.moments, list(cfg.group_sizes)),
        }
        report["policies"].append(entry)
        if world.is_main:
            log(f"{spec}: mean reward {entry['reward_mean']:.3f}")
    if world.is_main:  # every rank holds the same report; one writes it
        (out / "mse.json").write_text(json.dumps(report, indent=2))
        from grpolab.analysis.plots import plot_mse

        plot_mse(report, out / "mse.png")
    return report


def format_mse(report: dict) -> str:
    lines = []
    for entry in report["policies"]:
        lines.append(
            f"{entry['policy']} (mean reward {entry['reward_mean']:.3f}): MSE per prompt, mean over prompts [95% CI]"
        )
        Gs = sorted({r["G"] for r in entry["results"]})
        lines.append(f"  {'estimator':<9}" + "".join(f"{'G=' + str(G):>24}" for G in Gs))
        for est in MSE_ESTIMATORS:
            cells = {r["G"]: r for r in entry["results"] if r["estimator"] == est}
            lines.append(
                f"  {est:<9}"
                + "".join(
                    f"{cells[G]['mse']:>9.3g} [{cells[G]['ci_low']:.2g},{cells[G]['ci_high']:.2g}]".rjust(24)
                    if G in cells
                    else f"{'-':>24}"
                    for G in Gs
                )
            )
    return "\n".join(lines)


@fields.sectioned
class GroupsizeConfig(ProbeConfig):
    """Predict the best group size G under a fixed sampling budget B * G [U-statistic, Thm 7].

    Estimates the three constants of the rloo minibatch MSE (Prop. 3),
    MSE(B, G) = (1/B) [sigma_P^2 + sigma_O^2 / G + 2 tau^2 / (G (G - 1))] (prompt sampling,
    oracle, second-order residual), with bootstrap intervals over prompts, and the G* that
    minimises it at B = budget / G: G* = 1 + sqrt(2 tau^2 / sigma_P^2), whatever the budget.

    The token-masking options of training (--mask-truncated, --top-entropy-quantile) are not applied: the MSE
    decomposition needs psi to be a score (mean 0), which a masked psi is not; `grpolab rank` measures the masked
    gradient.
    """

    policy: str = "builtin"
    """The policy: 'builtin', smollm2-135m-instruct, a model directory, a run directory (its newest checkpoint) or
    a run's checkpoint directory (measured on its run's task)."""
    step: int | None = None
    """With a run directory as --policy: its checkpoint of this step (0 = the run's starting model, on the run's
    task); default: the newest."""
    budget: int = 64
    """Rollouts per step, B * G."""
    prompts: int = 32
    """Probe questions (>= 2; sigma_P^2 needs pairs of prompts)."""
    pool: int = 16
    """Rollouts per prompt (>= 3)."""
    out: str = "runs/groupsize"
    """Output directory (groupsize.json, groupsize.png)."""
    bootstrap: int = 1000
    """Bootstrap resamples of the prompts for the intervals."""
    sketch_dim: int | None = None
    """Cross-prompt gradient products from a k-dimensional CountSketch (unbiased): None = only when the M gradient
    vectors would exceed 1 GB (a real model), 0 = always exact, k > 0 = always sketched."""

    def validate(self) -> None:
        if self.budget < 2:
            raise ConfigError(f"--budget must be >= 2, got {self.budget}")
        if self.pool < 3:
            raise ConfigError(f"--pool must be >= 3 rollouts per prompt, got {self.pool}")
        if self.prompts < 2:
            raise ConfigError(f"--prompts must be >= 2, got {self.prompts}")


def _interval(values: list[float]) -> list[float]:
    finite = sorted(v for v in values if math.isfinite(v))
    if len(finite) < len(values) * 0.975:  # more than the upper tail is infinite
        lo = finite[int(0.025 * len(values))] if finite else math.inf
        return [lo, math.inf]
    return list(percentile_interval(finite))


def _pool(cfg: MseConfig | GroupsizeConfig, task, policy, records, world, log, given: Given, label: str = "pool"):
    """The probe's pool of ``cfg.pool`` rollouts per prompt, drawn and scored as ``task`` (the run's) draws and
    scores them, with their score Gram moments (``grpolab.analysis.pool``)."""
    with contextlib.closing(probe_sampler(policy, task, cfg.rollout_engine, log, records, given)) as draw:
        return collect_pool(
            policy,
            records,
            cfg.pool,
            draw,
            seed=cfg.seed,
            include=cfg.include or None,
            progress=cfg.progress,
            label=label,
            world=world,
            sketch_dim=cfg.sketch_dim,
            log=log,
        )


def run_groupsize(cfg: GroupsizeConfig, log=print, given: Given = NOTHING) -> dict:
    set_threads(cfg.threads)
    world = distributed.init()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    target = resolve_target(cfg.policy, cfg.step)
    task, records, sampler = probe_task(target, cfg, given)
    cfg = task.fill(cfg)
    policy = load_task_policy(target, task, sampler=sampler, given=given)
    pool = _pool(cfg, task, policy, records, world, log, given)
    consts = groupsize_constants(pool.moments, pool.cross)
    gen = torch.Generator().manual_seed(cfg.seed)
    M = len(pool.moments)
    boots = []
    for _ in range(cfg.bootstrap):
        idx = torch.randint(0, M, (M,), generator=gen)
        if (idx == idx[0]).all():
            continue
        boots.append(groupsize_constants(pool.moments, pool.cross, idx))
    Gs = [G for G in range(2, cfg.budget + 1) if cfg.budget % G == 0]
    curve = []
    for G in Gs:
        vals = [predicted_mse(b, G, cfg.budget) for b in boots]
        curve.append({"G": G, "B": cfg.budget // G, "mse": predicted_mse(consts, G, cfg.budget), "ci": _interval(vals)})
    g_star = optimal_group_size(consts)
    best = min(curve, key=lambda c: c["mse"])
    report = {
        "config": fields.to_flat(cfg),
        "reward_mean": statistics.fmean(pool.reward_mean),
        "constants": {
            k: {"value": consts[k], "ci": _interval([b[k] for b in boots])}
            for k in ("sigma_prompt", "sigma_oracle", "tau2", "grad_norm_sq")
        },
        "g_star": g_star,
        "g_star_ci": _interval([optimal_group_size(b) for b in boots]),
        "best_divisor_g": best["G"],
        "curve": curve,
    }
    if world.is_main:  # the bootstrap is seeded: every rank computed the same report
        (out / "groupsize.json").write_text(json.dumps(report, indent=2))
        from grpolab.analysis.plots import plot_groupsize

        plot_groupsize(report, out / "groupsize.png")
    return report


def format_groupsize(report: dict) -> str:
    c = report["constants"]
    cfg = report["config"]
    lines = [
        f"{cfg['policy']}: mean reward {report['reward_mean']:.3f}; {cfg['prompts']} prompts x {cfg['pool']} rollouts",
        "constants (95% bootstrap interval over prompts):",
    ]
    names = {
        "sigma_prompt": "sigma_P^2 (prompt sampling)",
        "sigma_oracle": "sigma_O^2 (oracle, x 1/G)",
        "tau2": "tau^2 (residual, x 2/(G(G-1)))",
        "grad_norm_sq": "||grad J||^2",
    }
    for k, name in names.items():
        lines.append(f"  {name:<32} {c[k]['value']:>10.4g}  [{c[k]['ci'][0]:.3g}, {c[k]['ci'][1]:.3g}]")
    lines.append(f"predicted MSE at budget B*G = {cfg['budget']}:")
    for row in report["curve"]:
        lines.append(f"  G={row['G']:>3} B={row['B']:>3}  {row['mse']:.4g}  [{row['ci'][0]:.3g}, {row['ci'][1]:.3g}]")
    lines.append(
        f"G* = {report['g_star']:.2f}  [{report['g_star_ci'][0]:.2f}, {report['g_star_ci'][1]:.2f}]; "
        f"best G dividing the budget: {report['best_divisor_g']}"
    )
    return "\n".join(lines)
