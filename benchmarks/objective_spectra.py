"""What each policy term does to the gradient, from one checkpoint: the spectrum of the per-rollout gradient matrix
(effective rank, top-1 energy) of each --loss-type's update, and where its update moves the log-probs.

The same G rollouts of each of --prompts probe prompts (the probe's seeded draw, scored by the task's reward) are
given to every objective. For each objective, from the same weights:

1. first pass (ratio 1): the per-rollout rows sum_t w_it grad log pi(o_it), w = d loss / d logp
   (grpolab.algo.loss.logp_weights), and one AdamW step on every probe group's loss (whole-step normalisers);
2. second pass (mu = 2): the same rows at the moved weights, against the sampling-time log-probs, where the
   objectives part ways (ratios away from 1), and a second AdamW step;
3. after the two steps: |d log pi| per token, and each group's share of it on the final-answer tokens
   (token_credit's segments).

Rank, top-1 energy and the answer share are means over the prompts whose rewards vary, with normal 95% intervals
over those prompts.
At ratio 1 every objective has the clip's direction for its aggregation (tests/algo/test_objectives.py), so the
first-pass spectrum is measured once per direction (seq-mean-token-sum's is token-mean's, times a constant). Writes
objectives.json into --out; prints a line per objective as it finishes.

    python benchmarks/objective_spectra.py --model smollm2-135m-instruct --data train.parquet \\
        --reward-fn reward.py:last_letter --max-new-tokens 16 --prompts 48 --group-size 8 --lr 2e-5 --out runs/obj
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time
from pathlib import Path

import torch

from grpolab.algo.advantages import compute_advantages
from grpolab.algo.loss import logp_weights, policy_loss
from grpolab.analysis.pool import probe_sampler
from grpolab.analysis.rank import RankConfig
from grpolab.common import streams
from grpolab.common.given import NOTHING
from grpolab.common.rng import set_threads
from grpolab.common.stats import mean_ci, percentile_interval
from grpolab.config.objective import TermSection
from grpolab.config.rollout import RewardSection
from grpolab.eval.runs import check_intact, load_task_policy, probe_task, run_targets
from grpolab.models.logprobs import completion_logprobs
from grpolab.probes.gram import score_gram
from grpolab.probes.mse import rows_mse
from grpolab.probes.spectrum import singular_values_from_gram, spectrum_metrics
from grpolab.probes.token_credit import token_segments, token_spans

# name: policy_loss options (each with the aggregation TRL gives it; clip twice, to separate aggregation from term)
OBJECTIVES = {
    "clip": dict(loss_type="clip", aggregation="seq-mean-token-mean"),
    "clip-token-mean": dict(loss_type="clip", aggregation="token-mean"),
    "cispo": dict(loss_type="cispo", aggregation="token-mean"),
    "sapo": dict(loss_type="sapo", aggregation="seq-mean-token-mean"),
    "luspo": dict(loss_type="luspo", aggregation="seq-mean-token-sum", importance_sampling="sequence"),
    "vespo": dict(loss_type="vespo", aggregation="token-mean"),
}


def draw_groups(args) -> tuple:
    """The probe's policy and its live groups: (batch, rewards, advantages) of each prompt whose rewards vary."""
    reward = RewardSection(reward_fn=tuple(args.reward_fn)) if args.reward_fn else RewardSection()
    cfg = RankConfig(
        checkpoint=args.model, data=args.data, reward=reward, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, prompts=args.prompts, group_sizes=(args.group_size,), seed=args.seed,
    )  # fmt: skip
    step, target = run_targets(cfg.checkpoint)[-1]
    target = check_intact(target)
    task, records, sampler = probe_task(target, cfg, NOTHING)
    policy = load_task_policy(target, task, sampler=sampler)
    policy.model.eval()
    groups, pools = [], []
    with contextlib.closing(probe_sampler(policy, task, "hf", print, records)) as draw:
        for k, record in enumerate(records[: args.prompts]):
            batch, rewards, _ = draw(record, args.group_size, (streams.PROBE, args.seed, step, k))
            if bool((rewards != rewards[0]).any()):
                groups.append((batch, rewards, compute_advantages(rewards[None, :].float(), "grpo_std")[0]))
            if args.mse_pool:  # `grpolab mse`'s pool keys
                pools.append(draw(record, args.mse_pool, (streams.POOL, args.seed, k))[:2])
    return policy, groups, pools


# Each aggregation's ratio-1 row as a multiple of the plain score psi_i = sum_t grad log pi(o_it), from the lengths
# |o_i| [N] of a pool: seq-mean-token-mean (clip, sapo) divides by the rollout's length; token-mean (cispo, vespo)
# by the group's token count, held here at its mean over the pool (the MSE needs rows that depend on one rollout
# each); seq-mean-token-sum (luspo) keeps psi_i.
ROW_SCALES = {
    "seq-mean-token-mean": lambda L: 1.0 / L,
    "token-mean": lambda L: torch.full_like(L, 1.0 / float(L.mean())),
    "seq-mean-token-sum": lambda L: torch.ones_like(L),
}


def _ratio_ci(num: list[float], den: list[float], seed: int = 0) -> tuple[float, float, float]:
    """sum(num) / sum(den) over prompts with a 95% percentile bootstrap interval (prompts resampled)."""
    n, d = torch.tensor(num, dtype=torch.float64), torch.tensor(den, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(num), (2000, len(num)), generator=gen)
    lo, hi = percentile_interval((n[idx].sum(1) / d[idx].sum(1)).tolist())
    return float(n.sum() / d.sum()), lo, hi


def pool_mse(policy, pools, G: int, temperature: float) -> dict:
    """Per aggregation, at ratio 1: the MSE at G of the grpo estimator and of the oracle about the oracle's mean, mean
    over prompts with 95% intervals, and their ratio (grpolab.probes.mse.rows_mse: the rows need not be scores)."""
    per, spread = {d: [] for d in ROW_SCALES}, 0
    for batch, rewards in pools:
        if bool((rewards == rewards[0]).all()):  # no spread in the pool: every estimate is 0
            for rows in per.values():
                rows.append({"grpo": 0.0, "rloo": 0.0, "oracle": 0.0})
            continue
        spread += 1
        psi = score_gram(policy.model, batch, batch.completion_mask.double(), temperature=temperature)  # [N, N]
        L = batch.completion_mask.sum(dim=1).double()  # [N]
        for d, scale in ROW_SCALES.items():
            c = scale(L)
            per[d].append(rows_mse(psi * c[:, None] * c[None, :], rewards, G))
    by_aggregation = {}
    for d, rows in per.items():
        grpo, oracle = [r["grpo"] for r in rows], [r["oracle"] for r in rows]
        by_aggregation[d] = {
            "grpo": mean_ci(grpo),
            "rloo": mean_ci([r["rloo"] for r in rows]),
            "oracle": mean_ci(oracle),
            "grpo_over_oracle": _ratio_ci(grpo, oracle),
        }
    return {"pools_with_spread": spread, "by_aggregation": by_aggregation}


def _rows_spectrum(model, batch, old, adv, options, temperature: float) -> dict:
    """Spectrum of the group's per-rollout gradient rows under ``options`` at ``model``'s weights."""
    with torch.no_grad():
        logp = completion_logprobs(model, batch, temperature)
    w = logp_weights(logp, old, adv, batch.completion_mask, **options)  # [G, T]
    psi = score_gram(model, batch, w, temperature=temperature)
    return spectrum_metrics(singular_values_from_gram(psi, torch.ones(psi.shape[0], dtype=torch.float64)))


def _step(model, opt, groups, olds, options, temperature: float) -> dict:
    """One AdamW step on every group's loss, with the whole step's normalisers; the mean |log ratio| it started
    from and the share of tokens where the term clipped (truncated)."""
    opt.zero_grad(set_to_none=True)
    N = sum(b.completion_ids.shape[0] for b, _, _ in groups)
    tokens = float(sum(b.completion_mask.sum() for b, _, _ in groups))
    gap = clipped = 0.0
    for (batch, _, adv), old in zip(groups, olds):
        logp = completion_logprobs(model, batch, temperature)
        loss, st = policy_loss(logp, old, adv.double(), batch.completion_mask, num_seqs=N, num_tokens=tokens, **options)
        loss.backward()
        m = batch.completion_mask.bool()
        gap += float((logp.detach() - old)[m].abs().sum())
        clipped += float(st["clip_frac"]) * float(m.sum())
    opt.step()
    return {"abs_log_ratio": gap / tokens, "clip_frac": clipped / tokens}


def answer_shares(tokenizer, groups, olds, model, temperature: float) -> list[float]:
    """Each probe group's share of its sum |d log pi| (from the sampling-time log-probs to ``model``'s) that lies on
    final-answer tokens (token_credit's segments); NaN for a group whose log-probs did not move."""
    shares = []
    for (batch, _, _), old in zip(groups, olds):
        with torch.no_grad():
            d = (completion_logprobs(model, batch, temperature) - old).abs()
        on_answer = total = 0.0
        for i in range(batch.completion_ids.shape[0]):
            n = int(batch.completion_mask[i].sum())
            seg = token_segments(token_spans(tokenizer.decode, batch.completion_ids[i, :n].tolist()))
            on_answer += sum(float(d[i, t]) for t in range(n) if seg[t] == "answer")
            total += float(d[i, :n].sum())
        shares.append(on_answer / total if total else float("nan"))
    return shares


def one_objective(policy, groups, olds, name: str, options: dict, args, at_ratio1: dict) -> dict:
    """One objective's figures, from the policy's weights (``args``: lr, cispo_cap, temperature). ``at_ratio1``: the
    first pass's spectra by direction, shared by the objectives: at ratio 1 each term's rows are the clip's with its
    aggregation, and seq-mean-token-sum weighs tokens as token-mean does (times a constant)."""
    opts = {**options, "params": TermSection(cispo_cap=args.cispo_cap).term_params()}
    T = args.temperature
    model = copy.deepcopy(policy.model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    t0 = time.perf_counter()
    direction = "token-mean" if options["aggregation"] == "seq-mean-token-sum" else options["aggregation"]
    if direction not in at_ratio1:
        clip = {"loss_type": "clip", "aggregation": direction}
        at_ratio1[direction] = [_rows_spectrum(model, b, old, a, clip, T) for (b, _, a), old in zip(groups, olds)]
    first = at_ratio1[direction]
    pass1 = _step(model, opt, groups, olds, opts, T)
    second = [_rows_spectrum(model, b, old, a, opts, T) for (b, _, a), old in zip(groups, olds)]
    pass2 = _step(model, opt, groups, olds, opts, T)
    out = {"objective": name, "options": {k: v for k, v in options.items()}, "pass1": pass1, "pass2": pass2}
    for label, rows in (("ratio1", first), ("pass2", second)):
        for key in ("effective_rank", "top1_fraction"):
            out[f"{label}_{key}"] = mean_ci([r[key] for r in rows])
    out["answer_share"] = mean_ci([x for x in answer_shares(policy.tokenizer, groups, olds, model, T) if x == x])
    out["seconds"] = time.perf_counter() - t0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--data", default="")
    p.add_argument("--reward-fn", action="append", default=[])
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--cispo-cap", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--objectives", default=",".join(OBJECTIVES))
    p.add_argument("--mse-pool", type=int, default=16, help="rollouts per prompt for the MSE at ratio 1 (0: none)")
    p.add_argument("--out", default="runs/objectives")
    args = p.parse_args()
    set_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policy, groups, pools = draw_groups(args)
    print(f"{len(groups)} of {args.prompts} prompts have reward variance (G = {args.group_size})")
    mse = pool_mse(policy, pools, args.group_size, args.temperature) if pools else {}
    for d, m in mse.get("by_aggregation", {}).items():
        (g, gl, gh), (o, ol, oh), (q, ql, qh) = m["grpo"], m["oracle"], m["grpo_over_oracle"]
        print(f"MSE at ratio 1, {d:<20} grpo {g:.4g} [{gl:.4g}, {gh:.4g}] oracle {o:.4g} [{ol:.4g}, {oh:.4g}] "
              f"grpo / oracle {q:.3f} [{ql:.3f}, {qh:.3f}]")  # fmt: skip
    olds = []
    for batch, _, _ in groups:  # the sampling-time log-probs: the same for every objective
        with torch.no_grad():
            olds.append(completion_logprobs(policy.model, batch, args.temperature).double())
    results, at_ratio1 = [], {}
    for name in args.objectives.split(","):
        res = one_objective(policy, groups, olds, name, OBJECTIVES[name], args, at_ratio1)
        results.append(res)
        r1, r2 = res["ratio1_effective_rank"], res["pass2_effective_rank"]
        t1, t2 = res["ratio1_top1_fraction"], res["pass2_top1_fraction"]
        print(
            f"{name:<16} ratio 1: rank {r1[0]:.3f} [{r1[1]:.3f}, {r1[2]:.3f}] top1 {t1[0]:.3f} | "
            f"pass 2: rank {r2[0]:.3f} [{r2[1]:.3f}, {r2[2]:.3f}] top1 {t2[0]:.3f} [{t2[1]:.3f}, {t2[2]:.3f}] | "
            f"|log r| {res['pass2']['abs_log_ratio']:.4f} clipped {res['pass2']['clip_frac']:.3f} | "
            f"answer share {res['answer_share'][0]:.3f} [{res['answer_share'][1]:.3f}, {res['answer_share'][2]:.3f}] "
            f"({res['seconds']:.0f} s)"
        )
    (out / "objectives.json").write_text(
        json.dumps({"args": vars(args), "groups": len(groups), "mse": mse, "results": results}, indent=2)
    )


if __name__ == "__main__":
    main()
