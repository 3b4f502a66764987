"""``grpolab rank``: the spectrum of GRPO's per-rollout gradient matrix over a run's checkpoints.

For each checkpoint and group size R, each probe prompt gets R rollouts; their
advantages A and score Gram matrix Psi give K = diag(A) Psi diag(A), whose
eigenvalues are the squared singular values of G (rows A_i psi_i, [Foundations, Sec. 7]).

Largest possible rank: G = diag(A) Psi_rows has rank at most the number of
rollouts with a non-zero advantage, <= R (and <= D). The Foundations paper's Table 1 gives
R - 1, but the zero-sum constraint sum_i A_i = 0 removes no row: for R = 2,
A = (a, -a) and the rows a psi_1 and -a psi_2 are independent whenever psi_1 and
psi_2 are. (R - 1 is the rank bound of the *centred* scores psi_i - mean psi,
not of G.) The effective rank can never exceed the numerical rank, so the
paper's "effective rank ~2 for R = 2 with max rank 1" cannot both hold; we
report what the matrix measured allows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import torch

from grpolab.algo.advantages import compute_advantages
from grpolab.algo.loss import effective_aggregation, loss_token_mask
from grpolab.algo.names import AGGREGATIONS, ESTIMATORS, LOSS_TYPES
from grpolab.analysis.config import ProbeConfig
from grpolab.analysis.pool import ProbeSampler, probe_sampler
from grpolab.common import distributed, streams
from grpolab.common.batch import Batch
from grpolab.common.errors import ConfigError
from grpolab.common.given import NOTHING, Given
from grpolab.common.progress import progress_bar
from grpolab.common.rng import set_threads
from grpolab.common.stats import mean_ci
from grpolab.config import fields
from grpolab.config.fields import FROM_RUN
from grpolab.eval.runs import check_intact, load_task_policy, probe_task, run_targets
from grpolab.models.logprobs import completion_entropy, completion_logprobs
from grpolab.models.policy import Policy
from grpolab.probes.gram import gram_relative_error, score_gram, score_gram_reference, token_weights
from grpolab.probes.spectrum import advantage_effective_rank, singular_values_from_gram, spectrum_metrics


@fields.sectioned
class RankConfig(ProbeConfig):
    """Spectrum of the per-rollout gradient matrix (effective rank, top-1 fraction) over checkpoints."""

    checkpoint: str = "builtin"
    """A run directory (every checkpoint in it, plus its starting model as step 0), or one model ('builtin',
    smollm2-135m-instruct, a directory, a checkpoint). A run's task and prompt format are used."""
    out: str = "runs/rank"
    """Output directory: rank.json and PNG plots."""
    steps: tuple[int, ...] = ()
    """With a run directory: only these steps (0 = its starting model); empty = all of them."""
    group_sizes: tuple[int, ...] = (2, 4, 8)
    """Group sizes R to measure."""
    prompts: int = 32
    """Probe prompts per checkpoint (the first of the task's fixed 500-question probe set)."""
    estimator: str = "grpo"
    """Advantage estimator for A (the Foundations paper analyses the group mean, 'grpo')."""
    aggregation: str = dataclasses.field(default="seq-mean-token-mean", metadata=FROM_RUN)
    """Per-token weights of psi, as in the loss (1/|o_i| for GRPO; a run: its own)."""
    loss_type: str = dataclasses.field(default="clip", metadata=FROM_RUN)
    """The run's policy term: at the sampling weights (ratio 1) every --loss-type has the clip's gradient, so it
    changes only the aggregation (luspo: seq-mean-token-sum). A run: its own."""
    mask_truncated: bool = dataclasses.field(default=False, metadata=FROM_RUN)
    """Give completions cut at --max-new-tokens no weight, as --mask-truncated in training (a run: its own)."""
    top_entropy_quantile: float = dataclasses.field(default=1.0, metadata=FROM_RUN)
    """Only the highest-entropy q-fraction of each prompt's R rollouts' tokens carries weight, as in training
    (a run: its own)."""
    sketch_dim: int = 0
    """If > 0, estimate Psi from a k-dimensional CountSketch of the per-rollout gradients instead of
    exactly (for models where the exact path is too slow). Its error: measured against the exact
    reference with --verify (gram_max_rel_err), otherwise about sqrt(2/k) per entry on the cosine scale."""
    verify: bool = False
    """Also run the R-backward reference path: gram_max_rel_err and time ratios."""
    compare_estimators: tuple[str, ...] = ()
    """Also the spectrum of each of these estimators' gradient matrix (vanilla, grpo, grpo_std, rloo), on the same
    rollouts and the same Gram matrix (one pass: an estimator only rescales the rows A_i psi_i), over the prompts
    whose rewards vary: results' by_estimator."""


def _plain_forward_backward_s(model, batch: Batch, weights: torch.Tensor, temperature: float) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    (completion_logprobs(model, batch, temperature) * weights.float()).sum().backward()
    elapsed = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return elapsed


def measure_prompt(policy: Policy, sampler: ProbeSampler, record: dict, R: int, key: tuple, cfg: RankConfig) -> dict:
    """Spectrum metrics of one prompt's R rollouts, drawn and scored by ``sampler`` (and, with verify, the reference
    check)."""
    batch, rewards, entropy = sampler(record, R, key)
    if entropy is None and cfg.top_entropy_quantile < 1:  # an engine without entropies (vLLM): one forward
        entropy = completion_entropy(policy.model, batch, cfg.temperature)
    adv = compute_advantages(rewards[None, :], cfg.estimator)[0]  # [R]
    row = {
        "reward_mean": float(rewards.float().mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "zero_var": bool((rewards == rewards[0]).all()),
        "distinct_active": distinct_active_rollouts(batch, adv),
        "adv_effective_rank": advantage_effective_rank(adv),
    }
    if not adv.any() and not cfg.verify:
        row.update(spectrum_metrics(torch.zeros(R)))
        return row
    # the loss's per-token weights, times the tokens that carry loss (--mask-truncated, --top-entropy-quantile)
    aggregation = effective_aggregation(cfg.loss_type, cfg.aggregation)
    weights = token_weights(batch.completion_mask, aggregation, cfg.max_new_tokens) * loss_token_mask(
        batch.completion_ids,
        batch.completion_mask,
        policy.eos_id,
        mask_truncated=cfg.mask_truncated,
        entropy=entropy,
        top_entropy_quantile=cfg.top_entropy_quantile,
    )
    t0 = time.perf_counter()
    psi = score_gram(
        policy.model,
        batch,
        weights,
        temperature=cfg.temperature,
        include=cfg.include or None,
        sketch_dim=cfg.sketch_dim,
        sketch_seed=cfg.seed,
    )
    t_gram = time.perf_counter() - t0
    row.update(spectrum_metrics(singular_values_from_gram(psi, adv)))
    if cfg.compare_estimators and not row["zero_var"]:
        row["by_estimator"] = {
            est: spectrum_metrics(singular_values_from_gram(psi, a))
            for est, a in estimator_advantages(rewards, cfg.compare_estimators).items()
        }
    if cfg.verify:
        t0 = time.perf_counter()
        ref = score_gram_reference(
            policy.model, batch, weights, temperature=cfg.temperature, include=cfg.include or None
        )
        t_ref = time.perf_counter() - t0
        t_plain = _plain_forward_backward_s(policy.model, batch, weights, cfg.temperature)
        row.update(gram_rel_err=gram_relative_error(psi, ref), t_gram=t_gram, t_ref=t_ref, t_plain=t_plain)
    return row


def estimator_advantages(rewards: torch.Tensor, estimators) -> dict[str, torch.Tensor]:
    """Each estimator's advantages ``[R]`` of one group's rewards ``[R]``: the row weights of its gradient matrix
    (rows A_i psi_i, the scores psi_i the same for all). grpo, grpo_std and rloo are positive multiples of
    r_i - mean r within a group (1, 1/(std + 1e-4), R/(R-1)), so their per-prompt spectra differ only in scale, and
    the effective rank and top-1 fraction, which are scale-free, are equal; vanilla (A = r) is not centred."""
    return {est: compute_advantages(rewards[None, :], est)[0] for est in estimators}


def distinct_active_rollouts(batch: Batch, adv: torch.Tensor) -> int:
    """How many different completions have a nonzero advantage: the rank G can reach for this prompt.

    Rows A_i psi_i of equal completions are parallel and rows with A_i = 0 vanish, so
    rank(G) <= this count (<= R); a sharpening policy repeats itself and the bound falls.
    """
    seqs = {
        tuple(ids[m].tolist()) for ids, m, a in zip(batch.completion_ids, batch.completion_mask.bool(), adv) if a != 0
    }
    return len(seqs)


def _summary(rows: list[dict], key: str) -> dict[str, float]:
    """Mean over prompts with its 95% interval (lo, hi; prompts are the independent unit), spread and range."""
    vals = [r[key] for r in rows]
    if not vals:
        return {"mean": None, "lo": None, "hi": None, "std": None, "min": None, "max": None, "n": 0}
    mean, lo, hi = mean_ci(vals)
    return {
        "mean": mean,
        "lo": None if math.isnan(lo) else lo,
        "hi": None if math.isnan(hi) else hi,
        "std": statistics.pstdev(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
    }


def _prompt_row(row: dict) -> dict:
    """A prompt's measurements as rank.json keeps them (for fits against its reward spread)."""
    keep = ("reward_mean", "reward_std", "zero_var", "distinct_active", "adv_effective_rank", "num_rank")
    return {k: row[k] for k in (*keep, "effective_rank", "top1_fraction") if k in row}


def select_steps(ckpts: list, steps: tuple[int, ...]) -> list:
    """The (step, target) pairs whose step is in ``steps`` (all if empty); an unknown step is an error."""
    if not steps:
        return ckpts
    have = [s for s, _ in ckpts]
    missing = sorted(set(steps) - set(have))
    if missing:
        raise ConfigError(f"--steps {missing}: not in this run (it has steps {have}; 0 is its start)")
    return [(s, t) for s, t in ckpts if s in steps]


def run_rank(cfg: RankConfig, log=print, given: Given = NOTHING) -> dict:
    for est in (cfg.estimator, *cfg.compare_estimators):
        if est not in ESTIMATORS or est == "oracle":
            choices = ", ".join(e for e in ESTIMATORS if e != "oracle")
            raise ConfigError(f"rank: estimator {est!r} is not one of {choices} (oracle needs true values: mse)")
    set_threads(cfg.threads)
    world = distributed.init()  # on P processes, each rank measures a block of the prompts
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpts = [(s, check_intact(t)) for s, t in select_steps(run_targets(cfg.checkpoint), cfg.steps)]
    task, records, sampler = probe_task(ckpts[0][1], cfg, given)
    cfg = task.fill(cfg)  # what was measured with: the run's sampling, reward and token options where not given
    if cfg.aggregation not in AGGREGATIONS or cfg.loss_type not in LOSS_TYPES:
        raise ConfigError(
            f"rank: aggregation {cfg.aggregation!r} / loss type {cfg.loss_type!r}: choose from {AGGREGATIONS} / "
            f"{LOSS_TYPES}"
        )
    mine = world.split(len(records))
    results = []
    total = len(ckpts) * len(cfg.group_sizes) * len(mine)
    with progress_bar("rank", total, enabled=cfg.progress and world.is_main) as bar:
        done = 0
        for step, target in ckpts:
            path = target.adapter or target.weights
            policy = load_task_policy(target, task, sampler=sampler, given=given)
            policy.model.eval()  # no dropout in the probe; gradients still flow
            with contextlib.closing(probe_sampler(policy, task, cfg.rollout_engine, log, records, given)) as draw:
                for R in cfg.group_sizes:
                    rows = []
                    for k in mine:  # global prompt index k keys the rollouts: P-independent
                        rows.append(
                            measure_prompt(policy, draw, records[k], R, (streams.PROBE, cfg.seed, step, k), cfg)
                        )
                        done += 1
                        bar.update(done, f"step {step} R={R}")
                    rows = distributed.gather_concat(rows, world)  # every prompt's row, in prompt order
                    res = _result(step, path, R, rows, cfg)
                    results.append(res)
    report = {"config": fields.to_flat(cfg), "results": results}
    if world.is_main:
        (out / "rank.json").write_text(json.dumps(report, indent=2))
        from grpolab.analysis.plots import plot_rank

        plot_rank(results, out)
    return report


def _result(step: int, path: str, R: int, rows: list[dict], cfg: RankConfig) -> dict:
    """One checkpoint's and group size's result from its prompts' rows: summaries over the prompts whose rewards
    vary, every prompt's row, and (--compare-estimators, --verify) what those options add."""
    live = [r for r in rows if not r["zero_var"]]
    res = {
        "step": step,
        "checkpoint": path,
        "R": R,
        "prompts": len(rows),
        "max_possible_rank": R,
        **(
            {"sketch_dim": cfg.sketch_dim, "sketch_expected_err": (2 / cfg.sketch_dim) ** 0.5} if cfg.sketch_dim else {}
        ),
        "frac_zero_var": sum(r["zero_var"] for r in rows) / len(rows),
        "reward_std_mean": statistics.fmean(r["reward_std"] for r in rows),
        **{
            k: _summary(live, k)
            for k in (
                "num_rank",
                "effective_rank",
                "top1_fraction",
                "distinct_active",
                "adv_effective_rank",
            )
        },
        "per_prompt": [_prompt_row(r) for r in rows],
    }
    if cfg.compare_estimators:
        res["by_estimator"] = {
            est: {
                k: _summary([r["by_estimator"][est] for r in live], k)
                for k in ("num_rank", "effective_rank", "top1_fraction")
            }
            for est in cfg.compare_estimators
        }
    if cfg.verify:
        res["gram_max_rel_err"] = max(r["gram_rel_err"] for r in rows)
        t_plain = sum(r["t_plain"] for r in rows)
        res["gram_time_ratio"] = sum(r["t_gram"] for r in rows) / t_plain
        res["reference_time_ratio"] = sum(r["t_ref"] for r in rows) / t_plain
    return res


def table1(results: list[dict]) -> str:
    """The Foundations paper's Table 1 shape: R, largest possible rank, effective rank, top-1 fraction (ranges over steps).

    Two more columns say what bounds the rank in practice: the numerical rank and the number
    of distinct completions with a nonzero advantage (means over prompts and steps).
    """
    lines = [
        f"{'R':>3} {'max rank':>9} {'eff. rank (mean, range over steps)':>36} {'top-1 frac (mean, range)':>28}"
        f" {'num. rank':>10} {'distinct':>9}"
    ]
    for R in sorted({r["R"] for r in results}):
        rs = [r for r in results if r["R"] == R and r["effective_rank"]["mean"] is not None]
        if not rs:
            lines.append(f"{R:>3} {R:>9} {'(no prompt with reward variance)':>36}")
            continue
        er = [r["effective_rank"]["mean"] for r in rs]
        tf = [r["top1_fraction"]["mean"] for r in rs]
        nr = statistics.fmean(r["num_rank"]["mean"] for r in rs)
        dist = [r["distinct_active"]["mean"] for r in rs if r.get("distinct_active", {}).get("mean") is not None]
        dist_s = f"{statistics.fmean(dist):>9.2f}" if dist else f"{'-':>9}"
        lines.append(
            f"{R:>3} {R:>9} {statistics.fmean(er):>14.2f} [{min(er):.2f}, {max(er):.2f}]{'':>10}"
            f"{statistics.fmean(tf):>10.2f} [{min(tf):.2f}, {max(tf):.2f}]{'':>6}{nr:>10.2f} {dist_s}"
        )
    return "\n".join(lines)


def _ci(s: dict) -> str:
    if s["mean"] is None:
        return f"{'-':>19}"
    if s.get("lo") is None:
        return f"{s['mean']:>6.2f}{'':>13}"
    return f"{s['mean']:>6.2f} [{s['lo']:.2f}, {s['hi']:.2f}]"


def table_by_step(results: list[dict]) -> str:
    """One row per checkpoint and R: means over the prompts with reward variance, with 95% intervals."""
    lines = [f"{'step':>5} {'R':>3} {'live':>9} {'num. rank':>19} {'eff. rank':>19} {'top-1 frac':>19}"]
    for r in results:
        live = f"{r['effective_rank']['n']}/{r['prompts']}"
        lines.append(
            f"{r['step']:>5} {r['R']:>3} {live:>9} {_ci(r['num_rank'])} {_ci(r['effective_rank'])} {_ci(r['top1_fraction'])}"
        )
    return "\n".join(lines)
