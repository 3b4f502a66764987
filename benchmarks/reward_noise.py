"""What a noisy (model-given) reward costs GRPO's gradient, against a verifier, from the same rollouts.

For each of --prompts prompts: --pool rollouts of the policy, each scored by every reward component of the run's
reward (grpolab's own RewardSection: the first --reward-fn is the verifier, every other --reward-fn or --reward-model
is a model reward), and the pool's score Gram matrix Psi (grpolab.probes.gram.score_gram). Each model reward is put
on the verifier's scale by the least-squares map r ~ a m + b over every rollout, and then, per prompt and unbiased
from the pool (grpolab.probes.mse, "a noisy reward against a verifier" [U-statistic, Thm 2]):

- agreement: the calibrated reward as a classifier of the verifier's pass/fail at 0.5 (--threshold), and the
  within-group Pearson correlation (prompts whose group varies in both);
- the MSE of grpo, rloo and oracle built on it against the verifier's true gradient at each --group-sizes G, its
  spread about its own mean, and the bias ||mu~ - mu||^2 that no G removes;
- the G at which that MSE falls to the verifier's own at G = --match-g (bootstrap interval over prompts);
- the effective rank of diag(A) Psi diag(A) over the pool (group-mean advantages; the whole pool is the group);
- two predictions beside the measurement: independent noise (r~ = r + e, s^2 the calibrated residual's variance
  within prompts) and errors in variables (r~ = k r + e within prompts, k and s^2 fitted), each from the
  verifier's moments alone;
- the scale-free view: cos(mu~, mu) over the stacked per-prompt gradients, and the MSE at the step size that
  minimises it.

    python benchmarks/reward_noise.py --policy smollm2-135m-instruct --data DIR/test.parquet \
        --reward-fn examples/last_letter/reward.py:last_letter --reward-model RM_DIR \
        --prompts 24 --pool 16 --max-new-tokens 16 --temperature 0.7 --threads 1 --out runs/reward-noise

Every option of grpolab's probes is a flag here, the reward's spelled as `grpolab train` spells them
(--reward-weights, --reward-model-device, ...), and --config FILE.toml gives defaults. The reward weights do not
matter: each component is read by its name. Writes pool.pt (the pool: Psi and every component's rewards, which
--from-pool analyses again without sampling), reward_noise.json (every per-prompt quantity) and reward_noise.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from grpolab.analysis.config import ProbeConfig
from grpolab.commands.parsing import parse_config
from grpolab.common.errors import ConfigError
from grpolab.common.rng import set_threads
from grpolab.common.stats import mean_ci, percentile_interval
from grpolab.config import fields
from grpolab.config.fields import FROM_RUN
from grpolab.probes.mse import derived_constants, mse_from_moments, prompt_moments
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
from grpolab.probes.spectrum import singular_values_from_gram, spectrum_metrics

NOT_MODELS = ("format", "overlong")  # components a run adds of its own: neither the verifier nor a model reward
GS = range(2, 1025)  # the group sizes searched for a G that matches the verifier's MSE


@fields.sectioned
class NoiseConfig(ProbeConfig):
    """A model reward against a verifier on the same rollouts: agreement, gradient MSE, bias, effective rank."""

    policy: str = "smollm2-135m-instruct"
    """The policy: 'builtin', smollm2-135m-instruct, a model directory or a run directory."""
    max_new_tokens: int = dataclasses.field(default=16, metadata=FROM_RUN)
    """Longest completion."""
    temperature: float = dataclasses.field(default=0.7, metadata=FROM_RUN)
    """Sampling temperature."""
    prompts: int = 24
    """Probe prompts M: the first M records of --data (or of the run's held-out split)."""
    pool: int = 16
    """Rollouts per prompt N (>= 3); every G is measured from the same pool."""
    group_sizes: tuple[int, ...] = (2, 4, 8, 16)
    """Group sizes G of the MSE table."""
    match_g: int = 4
    """The verifier's group size whose MSE a model reward's group size is matched to."""
    threshold: float = 0.5
    """Calibrated value at and above which the model reward counts as a pass (for its accuracy)."""
    bootstrap: int = 1000
    """Bootstrap resamples of the prompts (intervals of ratios: cosine, matched G, best-scale MSE)."""
    out: str = "runs/reward-noise"
    """Output directory: pool.pt, reward_noise.json, reward_noise.md."""
    from_pool: str = ""
    """Analyse this saved pool.pt instead of sampling (the analysis options above still apply)."""

    def validate(self) -> None:
        if self.pool < 3:
            raise ConfigError(f"--pool must be >= 3, got {self.pool}")
        if self.prompts < 2:
            raise ConfigError(f"--prompts must be >= 2, got {self.prompts}")
        if not self.group_sizes or min(self.group_sizes) < 2 or self.match_g < 2:
            raise ConfigError("--group-sizes and --match-g must be >= 2")
        if self.nproc != 1:
            raise ConfigError("--nproc: this benchmark runs in one process")


# ---------------------------------------------------------------- sampling: the pool, drawn once


def draw_pool(cfg: NoiseConfig, log=print) -> tuple[dict, NoiseConfig]:
    """Every prompt's N rollouts, each scored by every reward component, and their score Gram matrix: ``psi``
    ``[M, N, N]``, ``rewards`` name -> ``[M, N]``, the completions' ``texts``; with the config as measured."""
    from grpolab.analysis.pool import probe_sampler
    from grpolab.common import streams
    from grpolab.common.progress import progress_bar
    from grpolab.eval.runs import load_task_policy, probe_task, resolve_target
    from grpolab.probes.gram import score_gram

    start = time.perf_counter()
    target = resolve_target(cfg.policy)
    task, records, sampler = probe_task(target, cfg)
    cfg = task.fill(cfg)  # what was measured with: the run's sampling and reward options where not given
    policy = load_task_policy(target, task, sampler=sampler)
    policy.model.eval()
    psis, texts, rewards, errors = [], [], {}, 0
    seconds = {"generate": 0.0, "score": 0.0, "gram": 0.0}
    with contextlib.closing(probe_sampler(policy, task, cfg.rollout_engine, log, records)) as draw:
        names = draw.reward.names
        _check_components(names)
        with progress_bar("pool", len(records), enabled=cfg.progress) as bar:
            for k, record in enumerate(records):
                keys = [(streams.POOL, cfg.seed, k, i) for i in range(cfg.pool)]  # as grpolab mse draws its pool
                rows, gen_s, score_s = draw.service.sample([record] * cfg.pool, keys, draw.settings)
                t0 = time.perf_counter()
                weights = rows.batch.completion_mask.double()  # [N, T]: the plain score, E psi = 0
                psi = score_gram(
                    policy.model, rows.batch, weights, temperature=cfg.temperature, include=cfg.include or None
                )  # [N, N]
                seconds["gram"] += time.perf_counter() - t0
                seconds["generate"] += gen_s
                seconds["score"] += score_s
                psis.append(psi)
                texts.append(list(rows.texts))
                errors += rows.scores.errors  # (rollout, function) pairs that raised or were not finite: scored 0
                for name in names:
                    rewards.setdefault(name, []).append(rows.scores.components[name].double())
                bar.update(k + 1, " ".join(f"{n} {float(torch.stack(v).mean()):.2f}" for n, v in rewards.items()))
    pool = {
        "psi": torch.stack(psis),
        "rewards": {n: torch.stack(v) for n, v in rewards.items()},
        "names": names,
        "texts": texts,
        "prompts": [str(r.get("word", r.get("prompt"))) for r in records],
        "seconds": {**seconds, "total": time.perf_counter() - start},
        "reward_errors": errors,
        "config": fields.to_flat(cfg),
    }
    return pool, cfg


def _check_components(names: list[str]) -> None:
    if len([n for n in names[1:] if n not in NOT_MODELS]) < 1:
        raise ConfigError(
            f"the reward has components {names}: give the verifier as the first --reward-fn and at least one model "
            "reward (--reward-model DIR, or a second --reward-fn)"
        )


# ---------------------------------------------------------------- analysis: per prompt, then over prompts


def _ci(values) -> dict:
    values = [v for v in values if math.isfinite(v)]
    mean, lo, hi = mean_ci(values) if values else (math.nan, math.nan, math.nan)
    return {"mean": mean, "ci": [lo, hi], "n": len(values)}


def _boot(stat, M: int, reps: int, seed: int) -> list[float]:
    """The percentile interval of ``stat(idx)`` over ``reps`` resamples ``idx`` of the M prompts (seeded). nan
    (undefined on a resample) is left out; inf ("never") counts as the largest value."""
    gen = torch.Generator().manual_seed(seed)
    vals = [stat(torch.randint(0, M, (M,), generator=gen).tolist()) for _ in range(reps)]
    vals = [v for v in vals if not math.isnan(v)]
    return list(percentile_interval(vals)) if vals else [math.nan, math.nan]


def effective_rank(psi: torch.Tensor, r: torch.Tensor) -> float:
    """Effective rank of the rows A_i psi_i with group-mean advantages A over the whole pool."""
    return spectrum_metrics(singular_values_from_gram(psi, r - r.mean()))["effective_rank"]


def mse_curves(nms: list[dict], estimator: str, Gs: range) -> torch.Tensor:
    """``[M, len(Gs)]`` each prompt's MSE against the verifier's gradient at each G."""
    return torch.tensor([[mse_against_reference(nm, estimator, G) for G in Gs] for nm in nms], dtype=torch.float64)


def _first_g(curve: torch.Tensor, target: float, floor: float) -> float:
    """The first G of GS whose ``curve`` ``[len(GS)]`` value is at most ``target``; inf when ``floor`` (the limit as G
    grows) is at least ``target`` or no G up to 1024 reaches it."""
    if floor >= target:
        return math.inf
    below = (curve <= target).nonzero()
    return float(GS[int(below[0])]) if len(below) else math.inf


def _said(point: float | None, floor: float, target: float) -> str | int:
    if point is None or floor >= target:
        return "never"
    return ">1024" if point == math.inf else int(point)


def matched_g(nms: list[dict], estimator: str, match_g: int, reps: int, seed: int) -> dict:
    """The G at which the model reward's MSE falls to the verifier's at ``match_g`` (``matching_group_size``), with
    a bootstrap interval over prompts (curves over G = 2..1024 computed once, resampled as weights)."""
    target = statistics.fmean(mse_from_moments(nm["ref"], estimator, match_g) for nm in nms)
    point = matching_group_size(nms, estimator, target, g_max=GS[-1])
    curves = mse_curves(nms, estimator, GS)  # [M, 1023]
    targets = torch.tensor([mse_from_moments(nm["ref"], estimator, match_g) for nm in nms], dtype=torch.float64)
    bias = torch.tensor([nm["bias2"] for nm in nms], dtype=torch.float64)

    def stat(idx):
        return _first_g(curves[idx].mean(dim=0), float(targets[idx].mean()), float(bias[idx].mean()))

    floor = float(bias.mean())
    return {"target": target, "floor": floor, "G": _said(point, floor, target), "ci": _boot(stat, len(nms), reps, seed)}


def matched_g_scale_free(nms: list[dict], estimator: str, match_g: int, reps: int, seed: int) -> dict:
    """The G at which the model reward's best-scale MSE (``best_scale``: each reward at its own best step size) falls
    to the verifier's best-scale MSE at ``match_g``; never when the model's floor as G grows, ||mu||^2 - <mu~, mu>^2 /
    ||mu~||^2 (summed over prompts: the misalignment no step size removes), is at least that. Bootstrap interval."""

    def k(G):
        return (G - 1) / G if estimator == "grpo" else 1.0

    def t(values):
        return torch.tensor(values, dtype=torch.float64)

    second = t(
        [[estimator_spread(nm["model"], estimator, G) + k(G) ** 2 * nm["model"]["mu2"] for G in GS] for nm in nms]
    )
    cross = t([nm["cross"] for nm in nms])  # [M]
    ks = t([k(G) for G in GS])  # [len(GS)]
    ref, mod = t([nm["ref"]["mu2"] for nm in nms]), t([nm["model"]["mu2"] for nm in nms])
    kv = k(match_g)
    second_v = t([estimator_spread(nm["ref"], estimator, match_g) for nm in nms]) + kv * kv * ref

    def stat(idx):
        r, c, s, sv = ref[idx].mean(), cross[idx].mean(), second[idx].mean(dim=0), second_v[idx].mean()
        target = float(r - (kv * r) ** 2 / sv) if sv > 0 else float(r)
        floor = float(r - c * c / mod[idx].mean()) if mod[idx].mean() > 0 else float(r)
        return _first_g(r - (ks * c) ** 2 / s.clamp(min=1e-300), target, floor), target, floor

    point, target, floor = stat(list(range(len(nms))))
    return {
        "target": target,
        "floor": floor,
        "G": _said(point, floor, target),
        "ci": _boot(lambda idx: stat(idx)[0], len(nms), reps, seed),
    }


def analyse_model(pool: dict, name: str, cfg: NoiseConfig) -> dict:
    """Everything the report says of one model reward against the verifier (the pool's first component)."""
    psi, r, m = pool["psi"], pool["rewards"][pool["names"][0]], pool["rewards"][name]  # [M, N, N], [M, N], [M, N]
    M = r.shape[0]
    a, b = affine_calibration(m, r)
    rt = a * m + b  # [M, N] on the verifier's scale
    nms = [noisy_reward_moments(psi[x], r[x], rt[x]) for x in range(M)]
    agree = [agreement(r[x], rt[x], cfg.threshold) for x in range(M)]
    s2 = within_prompt_variance(rt - r)  # the independent-noise premise's s^2
    k_eiv, s2_eiv = within_prompt_slope(rt, r)  # errors in variables: r~ = k r + e within prompts
    pred = {
        "independent": [predicted_noisy_moments(nm["ref"], nm["psi2"], s2) for nm in nms],
        "errors_in_variables": [predicted_noisy_moments(nm["ref"], nm["psi2"], s2_eiv, k_eiv) for nm in nms],
    }
    ranks = [effective_rank(psi[x], rt[x]) for x in range(M)]
    varied = (r.std(dim=1) > 0).tolist()  # prompts whose verifier rewards vary
    rows = [_mse_row(nms, pred, est, G, cfg.bootstrap) for est in NOISE_ESTIMATORS for G in cfg.group_sizes]
    return {
        "calibration": {"a": a, "b": b, "s2_within": s2, "eiv_slope": k_eiv, "eiv_s2": s2_eiv},
        "accuracy": _ci([g["accuracy"] for g in agree]),
        "pearson": _ci([g["pearson"] for g in agree]),
        "auroc": _ci([g["auroc"] for g in agree]),
        "calibrated_range": [float(rt.min()), float(rt.max())],
        "gradient_slope": {  # <mu~, mu> / ||mu||^2 over the stacked prompts: the slope in gradient space
            "value": _gradient_slope(nms, range(M)),
            "ci": _boot(lambda idx: _gradient_slope(nms, idx), M, cfg.bootstrap, 4),
        },
        "effective_rank": _ci(ranks),
        "effective_rank_varied": _ci([q for q, v in zip(ranks, varied) if v]),
        "bias2": _ci([nm["bias2"] for nm in nms]),
        "cosine": {
            "value": gradient_cosine(nms),
            "ci": _boot(lambda i: gradient_cosine([nms[j] for j in i]), M, cfg.bootstrap, 1),
        },
        "constants": _constants(nms, pred),
        "matched_g": {est: matched_g(nms, est, cfg.match_g, cfg.bootstrap, 2) for est in NOISE_ESTIMATORS},
        "matched_g_scale_free": {
            est: matched_g_scale_free(nms, est, cfg.match_g, cfg.bootstrap, 3) for est in NOISE_ESTIMATORS
        },
        "mse": rows,
        "prompts": [
            {"prompt": pool["prompts"][x], **nm, **agree[x], "r_ref": r[x].tolist(), "r_cal": rt[x].tolist()}
            for x, nm in enumerate(nms)
        ],
    }


def _gradient_slope(nms: list[dict], idx) -> float:
    ref = sum(nms[j]["ref"]["mu2"] for j in idx)
    return sum(nms[j]["cross"] for j in idx) / ref if ref > 0 else math.nan


def _mse_row(nms: list[dict], pred: dict[str, list[dict]], est: str, G: int, reps: int) -> dict:
    """One estimator at one G: the verifier's MSE, the model's against the verifier's gradient, its spread, each
    prediction's, and the best-scale MSE of both (with a bootstrap interval for the model's)."""
    row = {
        "estimator": est,
        "G": G,
        "verifier": _ci([mse_from_moments(nm["ref"], est, G) for nm in nms]),
        "model": _ci([mse_against_reference(nm, est, G) for nm in nms]),
        "model_spread": _ci([estimator_spread(nm["model"], est, G) for nm in nms]),
    }
    measured = [mse_against_reference(nm, est, G) for nm in nms]
    for kind, pnms in pred.items():
        predicted = [mse_against_reference(p, est, G) for p in pnms]
        row[f"predicted_{kind}"] = _ci(predicted)
        row[f"measured_minus_{kind}"] = _ci([x - y for x, y in zip(measured, predicted)])  # paired over prompts
    lam, best = best_scale(nms, est, G)
    ci = _boot(lambda idx: best_scale([nms[j] for j in idx], est, G)[1], len(nms), reps, G)
    row["best_scale"] = {"lambda": lam, "mse": best, "ci": ci}
    lam_v, best_v = best_scale([{**nm, "model": nm["ref"], "cross": nm["ref"]["mu2"]} for nm in nms], est, G)
    row["verifier_best_scale"] = {"lambda": lam_v, "mse": best_v}
    return row


def _constants(nms: list[dict], pred: dict[str, list[dict]]) -> dict:
    """Mean over prompts of sigma_O^2, tau^2 (Thm 2's constants) of the verifier, the calibrated model reward and
    each prediction's, and E||psi||^2."""
    out = {"psi2": _ci([nm["psi2"] for nm in nms])}
    sources = {"verifier": [nm["ref"] for nm in nms], "model": [nm["model"] for nm in nms]}
    sources |= {f"predicted_{k}": [p["model"] for p in v] for k, v in pred.items()}
    derived = {who: [derived_constants(m) for m in moments] for who, moments in sources.items()}
    for who, dc in derived.items():
        out[who] = {c: _ci([d[c] for d in dc]) for c in ("sigma_oracle", "tau2")}
    for kind in pred:  # measured minus predicted, paired over prompts
        pairs = list(zip(derived["model"], derived[f"predicted_{kind}"]))
        out[f"model_minus_{kind}"] = {c: _ci([x[c] - y[c] for x, y in pairs]) for c in ("sigma_oracle", "tau2")}
    return out


def _majority_accuracy(r: torch.Tensor, threshold: float) -> list[float]:
    """Per prompt, the accuracy of a classifier that always answers the verifier's majority class over the pool: the
    accuracy a reward with no information gets."""
    passed = (r >= threshold).double()  # [M, N]
    majority = float(passed.mean()) >= 0.5
    return (passed if majority else 1 - passed).mean(dim=1).tolist()


def analyse(pool: dict, cfg: NoiseConfig) -> dict:
    verifier = pool["names"][0]
    psi, r = pool["psi"], pool["rewards"][verifier]
    M = r.shape[0]
    models = [n for n in pool["names"][1:] if n not in NOT_MODELS]
    ranks = [effective_rank(psi[x], r[x]) for x in range(M)]
    varied = (r.std(dim=1) > 0).tolist()
    return {
        "verifier": verifier,
        "reward_mean": {n: float(v.mean()) for n, v in pool["rewards"].items()},
        "frac_prompts_with_verifier_variance": float((r.std(dim=1) > 0).double().mean()),
        "verifier_effective_rank": _ci(ranks),
        "verifier_effective_rank_varied": _ci([q for q, v in zip(ranks, varied) if v]),
        "verifier_mu2": _ci([prompt_moments(psi[x], r[x])["mu2"] for x in range(M)]),
        "majority_accuracy": _ci(_majority_accuracy(r, cfg.threshold)),
        "models": {n: analyse_model(pool, n, cfg) for n in models},
    }


# ---------------------------------------------------------------- the report


def _cell(s: dict, fmt: str = ".3g") -> str:
    lo, hi = s["ci"]
    return f"{s['mean']:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def _interval(ci: list[float]) -> str:
    return "[" + ", ".join("inf" if v == math.inf else f"{v:.3g}" for v in ci) + "]"


def markdown(report: dict, cfg: dict, seconds: float) -> str:
    v = report["verifier"]
    lines = [
        f"# A model reward against the verifier `{v}`",
        "",
        f"Policy `{cfg['policy']}`, {cfg['prompts']} prompts of `{cfg['data'] or 'the run'}` x {cfg['pool']} rollouts "
        f"(temperature {cfg['temperature']}, at most {cfg['max_new_tokens']} new tokens, seed {cfg['seed']}); "
        f"pool drawn in {seconds:.0f} s. Mean reward: "
        + ", ".join(f"{n} {x:.3f}" for n, x in report["reward_mean"].items())
        + f"; {report['frac_prompts_with_verifier_variance']:.2f} of prompts have verifier variance; "
        f"{report.get('reward_errors', 0)} reward evaluations failed (scored 0). Intervals: 95% over prompts (normal "
        "for means, bootstrap percentile for cosine, gradient slope, matched G, best-scale MSE).",
    ]
    for name, m in report["models"].items():
        lines += ["", f"## `{name}`", ""]
        lines += _agreement_md(report, name, m, cfg)
        lines += _mse_md(report, name, m, cfg)
        lines += _scale_free_md(v, name, m, cfg)
        lines += _constants_md(m)
    return "\n".join(lines) + "\n"


def _agreement_md(report: dict, name: str, m: dict, cfg: dict) -> list[str]:
    c, v = m["calibration"], report["verifier"]
    lo, hi = m["calibrated_range"]
    g = m["gradient_slope"]
    return [
        f"Calibration r ~ a m + b over all rollouts: a = {c['a']:.4g}, b = {c['b']:.4g}; calibrated values span "
        f"[{lo:.3g}, {hi:.3g}]. Calibrated residual variance within prompts s^2 = {c['s2_within']:.4g}; errors in "
        f"variables r~ = k r + e within prompts: k = {c['eiv_slope']:.4g}, s^2 = {c['eiv_s2']:.4g}. Slope in gradient "
        f"space <mu~, mu> / ||mu||^2 = {g['value']:.3g} {_interval(g['ci'])}. Accuracy at calibrated threshold "
        f"{cfg['threshold']} (always answering the verifier's majority class: {_cell(report['majority_accuracy'])}); "
        "AUROC within groups, and correlation, over the prompts whose group the verifier splits.",
        "",
        "| reward | accuracy vs verifier | AUROC within group | within-group corr (prompts) | effective rank (pool), "
        f"all prompts | effective rank, the {report['verifier_effective_rank_varied']['n']} prompts with verifier "
        "variance | cos(mu~, mu) | bias ||mu~ - mu||^2 |",
        "|---|---|---|---|---|---|---|---|",
        f"| {v} | 1 | 1 | 1 | {_cell(report['verifier_effective_rank'])} | "
        f"{_cell(report['verifier_effective_rank_varied'])} | 1 | 0 |",
        f"| {name} | {_cell(m['accuracy'])} | {_cell(m['auroc'])} | {_cell(m['pearson'])} ({m['pearson']['n']}) | "
        f"{_cell(m['effective_rank'])} | {_cell(m['effective_rank_varied'])} | "
        f"{m['cosine']['value']:.3g} {_interval(m['cosine']['ci'])} | {_cell(m['bias2'])} |",
        "",
    ]


def _mse_md(report: dict, name: str, m: dict, cfg: dict) -> list[str]:
    v = report["verifier"]
    Gs = sorted({row["G"] for row in m["mse"]})
    lines = [
        "MSE against the verifier's true gradient, E||g - mu||^2, mean over prompts [95% CI]; 'spread' is the "
        "model estimator's MSE about its own mean (the rest is bias); 'measured - predicted' is paired over prompts. "
        f"For scale: ||mu||^2, the MSE of the estimator g = 0, is {_cell(report['verifier_mu2'])}.",
        "",
        "| estimator | what | " + " | ".join(f"G={G}" for G in Gs) + f" | G matching {v}@G={cfg['match_g']} |",
        "|---|---|" + "---|" * (len(Gs) + 1),
    ]
    what = {
        "verifier": f"{v} (measured)",
        "model": f"{name} (measured)",
        "model_spread": f"{name} spread",
        "predicted_independent": "predicted: independent noise s^2",
        "measured_minus_independent": "measured - predicted (independent)",
        "predicted_errors_in_variables": "predicted: errors in variables",
        "measured_minus_errors_in_variables": "measured - predicted (errors in variables)",
    }
    for est in NOISE_ESTIMATORS:
        cells = {row["G"]: row for row in m["mse"] if row["estimator"] == est}
        mg = m["matched_g"][est]
        for key, label in what.items():
            extra = f"{mg['G']} {_interval(mg['ci'])}" if key == "model" else ""
            lines.append(f"| {est} | {label} | " + " | ".join(_cell(cells[G][key]) for G in Gs) + f" | {extra} |")
    return lines + [""]


def _scale_free_md(v: str, name: str, m: dict, cfg: dict) -> list[str]:
    Gs = sorted({row["G"] for row in m["mse"]})
    lines = [
        "Scale-free: the MSE at the step size lambda* that minimises it (one for all prompts), lambda* in parentheses "
        "(the model's on its calibrated scale); the G at which the model's falls to the verifier's at "
        f"G={cfg['match_g']}, and the model's floor as G grows (misalignment no step size removes).",
        "",
        "| estimator | reward | " + " | ".join(f"G={G}" for G in Gs) + " | G matching | floor |",
        "|---|---|" + "---|" * (len(Gs) + 2),
    ]
    for est in NOISE_ESTIMATORS:
        cells = {row["G"]: row for row in m["mse"] if row["estimator"] == est}
        ver = [cells[G]["verifier_best_scale"] for G in Gs]
        lines.append(f"| {est} | {v} | " + " | ".join(f"{b['mse']:.3g} ({b['lambda']:.2f})" for b in ver) + " | | |")
        sf = m["matched_g_scale_free"][est]
        mod = [cells[G]["best_scale"] for G in Gs]
        lines.append(
            f"| {est} | {name} | "
            + " | ".join(f"{b['mse']:.3g} {_interval(b['ci'])} ({b['lambda']:.2f})" for b in mod)
            + f" | {sf['G']} {_interval(sf['ci'])} | {sf['floor']:.3g} |"
        )
    return lines + [""]


def _constants_md(m: dict) -> list[str]:
    k = m["constants"]
    lines = [
        f"Thm 2's constants, mean over prompts (E||psi||^2 = {_cell(k['psi2'])}); differences paired over prompts:",
        "",
        "| reward | sigma_O^2 | tau^2 |",
        "|---|---|---|",
    ]
    for who in (
        "verifier",
        "model",
        "predicted_independent",
        "model_minus_independent",
        "predicted_errors_in_variables",
        "model_minus_errors_in_variables",
    ):
        lines.append(f"| {who} | {_cell(k[who]['sigma_oracle'])} | {_cell(k[who]['tau2'])} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(NoiseConfig, sys.argv[1:] if argv is None else argv, "reward_noise.py", __doc__.split("\n\n")[0])
    cfg.validate()
    set_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if cfg.from_pool:
        pool = torch.load(cfg.from_pool, weights_only=False)
        print(f"pool of {len(pool['texts'])} prompts from {cfg.from_pool}")
    else:
        pool, cfg = draw_pool(cfg, print)
        torch.save(pool, out / "pool.pt")
        print(f"pool drawn in {time.perf_counter() - t0:.0f} s ({pool['seconds']}); saved to {out / 'pool.pt'}")
        if pool["reward_errors"]:
            print(f"warning: {pool['reward_errors']} reward evaluations raised or were not finite and count as 0")
    _check_components(pool["names"])
    report = analyse(pool, cfg)
    sampled = {k: pool["config"][k] for k in ("policy", "prompts", "pool", "temperature", "max_new_tokens", "seed")}
    shown = {**sampled, "data": pool["config"]["data"], "threshold": cfg.threshold, "match_g": cfg.match_g}
    report = {
        "config": fields.to_flat(cfg),
        "pool_config": pool["config"],
        "seconds": pool["seconds"],
        "reward_errors": pool.get("reward_errors", 0),
        **report,
    }
    (out / "reward_noise.json").write_text(json.dumps(report, indent=1))
    (out / "reward_noise.md").write_text(markdown(report, shown, pool["seconds"]["total"]))
    print((out / "reward_noise.md").read_text())
    print(f"wrote {out / 'reward_noise.json'} and {out / 'reward_noise.md'} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
