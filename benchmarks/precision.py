"""What sampling in bf16 does to the gradient, and what each --engine-correction mode does about it, at a checkpoint.

    python benchmarks/precision.py --model RUN_OR_MODEL [--step-index -1] [--data FILE] [--reward-fn FILE:FN]
                                   [--prompts 32] [--group-size 8] [--max-new-tokens 16] [--temperature 0.7]
                                   [--cap 2] [--out runs/precision]

For each probe prompt (the probe's seeded draw), G rollouts are drawn twice by grpolab's hf engine with the same keys,
so with the same uniforms: in fp32 (``--rollout-dtype float32``: the sampler's packed fp32 copy) and in bf16
(``--rollout-dtype bfloat16``). The trainer is the checkpoint in fp32. Per draw:

1. the token log-ratio log r = log pi_trainer - log pi_sampler over every completion token: quantiles, standard
   deviation, the share of tokens with r outside [0.9, 1.1], and the sequence log-ratio log R (as ``engine/*``);
2. per weighting of the policy term, with grpo_std advantages and the clip loss at ratio 1 (seq-mean-token-mean) over
   the prompts whose rewards vary: the four --engine-correction modes (cap ``--cap``), none, and ``exact``: every
   token of rollout i weighted by its whole sequence ratio R_i, uncapped, which makes the sum an unbiased estimate of
   the trainer's own on-policy gradient from the sampler's rollouts (importance sampling; the modes are its truncated
   or masked approximations, none ignores the mismatch):
   - the effective rank of each group's per-rollout gradient rows (mean over groups, 95% interval);
   - the relative error ||g - g_exact|| / ||g_exact|| and the cosine of the step's gradient g (all groups, the step's
     normalisers) against the same rollouts' exact on-policy gradient, and, per group, the same two figures as
     means with 95% intervals over the groups;
   - the same against the fp32 draw's gradient (mode none) of the same keys: where the bf16 sampler picked other
     tokens the draws differ, and no weight undoes that; this is the precision's whole effect on the step, sampling
     noise included.

Prints a line per draw and weighting; writes precision.json into ``--out``. ``--tables A/precision.json
B/precision.json`` prints the markdown tables of saved results (docs/precision.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path

import torch

from grpolab.algo.advantages import compute_advantages
from grpolab.algo.engine_correction import (
    CORRECTIONS,
    MAX_KEYS,
    engine_weights,
    mismatch_metrics,
    mismatch_sums,
)
from grpolab.algo.loss import logp_weights
from grpolab.analysis.pool import probe_sampler
from grpolab.analysis.rank import RankConfig
from grpolab.common import streams
from grpolab.common.given import NOTHING
from grpolab.common.rng import set_threads
from grpolab.common.stats import mean_ci
from grpolab.config.rollout import RewardSection
from grpolab.eval.runs import check_intact, load_task_policy, probe_task, run_targets
from grpolab.models.logprobs import completion_logprobs
from grpolab.probes.gram import score_gram
from grpolab.probes.spectrum import singular_values_from_gram, spectrum_metrics

DRAWS = ("float32", "bfloat16")
QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


def probe_setup(args) -> tuple:
    """The checkpoint's policy (fp32, eval mode), the probe's task and prompts, and the checkpoint's step, from the
    options both precision benchmarks take (``--model``, ``--step-index``, ``--data``, ``--reward-fn``, ...)."""
    reward = RewardSection(reward_fn=tuple(args.reward_fn)) if args.reward_fn else RewardSection()
    cfg = RankConfig(
        checkpoint=args.model, data=args.data, reward=reward, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, prompts=args.prompts, group_sizes=(args.group_size,), seed=args.seed,
    )  # fmt: skip
    step, target = run_targets(cfg.checkpoint)[args.step_index]
    task, records, sampler = probe_task(check_intact(target), cfg, NOTHING)
    policy = load_task_policy(target, task, sampler=sampler)
    policy.model.eval()
    return policy, task, records, step


def draw(args) -> tuple:
    """The checkpoint's policy (fp32) and, per dtype, each probe prompt's group: (batch, sampler log-probs,
    rewards), the same keys in both."""
    policy, task, records, step = probe_setup(args)
    groups = {}
    for dtype in DRAWS:
        with contextlib.closing(probe_sampler(policy, task, "hf", print, records, rollout_dtype=dtype)) as sample:
            groups[dtype] = [
                _group(sample, record, args.group_size, (streams.PROBE, args.seed, step, k))
                for k, record in enumerate(records[: args.prompts])
            ]
    return policy, step, groups


def _group(sample, record: dict, n: int, key: tuple) -> tuple:
    """n rollouts of one prompt through the probe's service: (batch, the sampler's log-probs ``[n, T]``, rewards)."""
    rows, _, _ = sample.service.sample([record] * n, [(*key, i) for i in range(n)], sample.settings)
    return rows.batch, rows.logprobs, rows.scores.total


def log_ratio_summary(groups, trainer: list[torch.Tensor]) -> dict:
    """The draw's token log-ratios: quantiles and the engine/* statistics over every completion token."""
    sums, logs = None, []
    for (batch, sampler_logp, _), logp in zip(groups, trainer):
        part = mismatch_sums(logp, sampler_logp.double(), batch.completion_mask)
        sums = part if sums is None else {k: (max if k in MAX_KEYS else sum)((sums[k], part[k])) for k in part}
        logs.append((logp - sampler_logp.double())[batch.completion_mask.bool()])
    d = torch.cat(logs)
    return {"quantiles": {q: float(d.quantile(q)) for q in QUANTILES}, "tokens": d.numel(), **mismatch_metrics(sums)}


WEIGHTINGS = ("exact", *CORRECTIONS)


def token_weights(groups, trainer, weighting: str, cap: float) -> list[torch.Tensor]:
    """d loss / d logp per token ``[G, T]`` of each group: the clip at ratio 1 with the weighting's token weights,
    grpo_std advantages, seq-mean-token-mean over the whole step (groups without reward spread: 0)."""
    N = sum(b.completion_ids.shape[0] for b, _, _ in groups)
    mode, cap = ("sequence-truncate", math.inf) if weighting == "exact" else (weighting, cap)
    out = []
    for (batch, sampler_logp, rewards), logp in zip(groups, trainer):
        adv = compute_advantages(rewards[None, :].double(), "grpo_std")[0]  # [G]
        w = engine_weights(logp, sampler_logp.double(), batch.completion_mask, mode, cap)  # [G, T]
        out.append(logp_weights(logp, logp, adv, batch.completion_mask, num_seqs=N, token_weights=w))
    return out


def group_gradient(model, batch, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """One group's share of the step's gradient, flat ``[D]`` float32: grad sum_it w_it log pi(o_it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    logp = completion_logprobs(model, batch, temperature)
    grads = torch.autograd.grad((logp.double() * w).sum(), params, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).float() for g, p in zip(grads, params)])


def effective_rank(model, batch, w: torch.Tensor, temperature: float) -> float:
    """Effective rank of a group's per-rollout gradient rows sum_t w_it grad log pi(o_it)."""
    psi = score_gram(model, batch, w, temperature=temperature)
    return spectrum_metrics(singular_values_from_gram(psi, torch.ones(psi.shape[0]).double()))["effective_rank"]


def compare(g: torch.Tensor, ref: torch.Tensor) -> dict:
    """Relative error ||g - ref|| / ||ref|| and cosine (in float64)."""
    g, ref = g.double(), ref.double()
    n = float(ref.norm())
    return {"rel_error": float((g - ref).norm()) / n, "cosine": float(g @ ref) / (float(g.norm()) * n)}


def measure_draw(
    model, groups, trainer, cap: float, temperature: float, fp32_step, names=WEIGHTINGS
) -> tuple[dict, torch.Tensor]:
    """Per weighting: per-group ranks and comparisons with the exact weighting, and the step's (all groups)
    comparisons with the exact weighting and with ``fp32_step`` (the fp32 draw's step gradient; None for that
    draw itself), for the weightings ``names`` (with exact and none always). Returns the figures and this draw's
    mode-none step gradient."""
    names = ("exact", "none", *(n for n in names if n not in ("exact", "none")))
    weights = {name: token_weights(groups, trainer, name, cap) for name in names}
    step = {name: None for name in names}
    per_group = {name: {"rank": [], "rel_error": [], "cosine": []} for name in names}
    for k, (batch, _, rewards) in enumerate(groups):
        if not bool((rewards != rewards[0]).any()):
            continue  # no reward spread: every advantage, so every weighting's gradient, is 0
        grads = {name: group_gradient(model, batch, weights[name][k], temperature) for name in names}
        for name, g in grads.items():
            step[name] = g if step[name] is None else step[name] + g
            row = per_group[name]
            row["rank"].append(effective_rank(model, batch, weights[name][k], temperature))
            for key, v in compare(g, grads["exact"]).items():
                row[key].append(v)
        del grads
    out = {}
    for name in names:
        out[name] = {f"group_{k}": mean_ci(v) for k, v in per_group[name].items()}
        out[name]["step_vs_exact"] = compare(step[name], step["exact"])
        out[name]["step_vs_fp32_draw"] = compare(step[name], fp32_step if fp32_step is not None else step["none"])
    return out, step["none"]


def tables(paths: list[str]) -> str:
    """Markdown tables of saved ``precision.json`` files (one per checkpoint): the log-ratio per draw, then the
    gradient per draw and weighting."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    lines = ["| step | draw | tokens | log r sd | r sd | outside [0.9, 1.1] | log R mean | log R sd | max \\|log R\\| | "
             + " | ".join(f"q{q:g}" for q in QUANTILES) + " |",
             "| ---: | --- |" + " ---: |" * (7 + len(QUANTILES))]  # fmt: skip
    for run in runs:
        for dtype, d in run["draws"].items():
            r = d["log_ratio"]
            figures = (r["engine/logratio_std"], r["engine/ratio_std"], r["engine/ratio_outside_frac"],
                       r["engine/seq_logratio_mean"], r["engine/seq_logratio_std"], r["engine/seq_logratio_max"])  # fmt: skip
            quantiles = " | ".join(f"{r['quantiles'][f'{q:g}']:+.2g}" for q in QUANTILES)
            lines.append(f"| {run['step']} | {dtype} | {r['tokens']} | "
                         + " | ".join(f"{x:.3g}" for x in figures) + f" | {quantiles} |")  # fmt: skip
    lines += ["", "| step | draw | groups with spread | weighting | effective rank (95% CI) | step: rel. error vs exact "
              "| step: cosine vs exact | per group: rel. error (95% CI) | step vs the fp32 draw: rel. error, cosine |",
              "| ---: | --- | ---: | --- | --- | ---: | ---: | --- | --- |"]  # fmt: skip
    for run in runs:
        for dtype, d in run["draws"].items():
            for name, f in d["weightings"].items():
                r, ge = f["group_rank"], f["group_rel_error"]
                se, sf = f["step_vs_exact"], f["step_vs_fp32_draw"]
                lines.append(f"| {run['step']} | {dtype} | {d['live_groups']} | {name} | {r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}] "
                             f"| {se['rel_error']:.3g} | {se['cosine']:.4f} | {ge[0]:.3g} [{ge[1]:.2g}, {ge[2]:.2g}] "
                             f"| {sf['rel_error']:.3f}, {sf['cosine']:.3f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model, or a run (its --step-index checkpoint)")
    p.add_argument("--step-index", type=int, default=-1, help="which of the run's checkpoints (0: its start)")
    p.add_argument("--data", default="")
    p.add_argument("--reward-fn", action="append", default=[])
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--cap", type=float, default=2.0, help="--engine-correction-cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--fp32-weightings",
        default=",".join(WEIGHTINGS),
        help="the weightings measured on the fp32 draw (exact and none always): its mismatch is rounding, so every "
        "mode gives none's gradient to about 1e-4; 'none' saves two thirds of its time",
    )
    p.add_argument("--out", default="runs/precision")
    p.add_argument("--tables", nargs="+", metavar="JSON", help="print markdown tables of saved precision.json files")
    args = p.parse_args()
    if args.tables:
        print(tables(args.tables))
        return
    set_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    policy, step, groups = draw(args)
    model, T = policy.model, args.temperature
    results: dict = {"args": vars(args), "step": step, "draws": {}}
    fp32_step = None
    for dtype in DRAWS:
        with torch.no_grad():
            trainer = [completion_logprobs(model, b, T).double() for b, _, _ in groups[dtype]]
        live = sum(bool((r != r[0]).any()) for _, _, r in groups[dtype])
        ratios = log_ratio_summary(groups[dtype], trainer)
        q = ratios["quantiles"]
        print(f"step {step} {dtype}: {live} of {args.prompts} groups with reward spread; log r quantiles "
              + " ".join(f"{k:g}:{v:+.2e}" for k, v in q.items())
              + f"; outside [0.9, 1.1] {ratios['engine/ratio_outside_frac']:.4f}", flush=True)  # fmt: skip
        names = args.fp32_weightings.split(",") if dtype == "float32" else WEIGHTINGS
        figures, none_step = measure_draw(model, groups[dtype], trainer, args.cap, T, fp32_step, names)
        fp32_step = none_step if dtype == "float32" else fp32_step
        results["draws"][dtype] = {"live_groups": live, "log_ratio": ratios, "weightings": figures}
        for name, f in figures.items():
            r, ge, gc = f["group_rank"], f["group_rel_error"], f["group_cosine"]
            se, sf = f["step_vs_exact"], f["step_vs_fp32_draw"]
            print(f"  {name:<18} rank {r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}] | vs exact: step rel {se['rel_error']:.2e} "
                  f"cos {se['cosine']:.5f}, per group rel {ge[0]:.2e} [{ge[1]:.2e}, {ge[2]:.2e}] cos {gc[0]:.5f} | "
                  f"vs fp32 draw: rel {sf['rel_error']:.3f} cos {sf['cosine']:.4f}", flush=True)  # fmt: skip
    results["seconds"] = time.perf_counter() - t0
    (out / "precision.json").write_text(json.dumps(results, indent=2))
    print(f"{out / 'precision.json'} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
