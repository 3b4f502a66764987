"""What sampling in bf16 does to the gradient, and what each --engine-correction mode does about it, at a checkpoint.

    python benchmarks/precision.py --model RUN_OR_MODEL [--data FILE --reward-fn FILE:FN] [--prompts 32]
                                   [--group-size 8] [--max-new-tokens 16] [--temperature 0.7] [--cap 2]
                                   [--out runs/precision]

For each probe prompt (the probe's seeded draw), G rollouts are drawn twice by grpolab's hf engine with the same keys,
so with the same uniforms: in fp32 (``--rollout-dtype float32``: the sampler's packed fp32 copy) and in bf16
(``--rollout-dtype bfloat16``). The trainer is the checkpoint in fp32. Per draw:

1. the token log-ratio log r = log pi_trainer - log pi_sampler over every completion token: quantiles, standard
   deviation, the share of tokens with r outside [0.9, 1.1], and the sequence log-ratio log R (as ``engine/*``);
2. per correction mode (none and the four of grpolab.algo.engine_correction, cap ``--cap``), with grpo_std
   advantages and the clip loss at ratio 1 (seq-mean-token-mean), over the prompts whose rewards vary:
   - the effective rank of each group's per-rollout gradient rows (mean over groups, 95% interval);
   - the step's gradient g (all groups, the step's normalisers), against the same rollouts' on-policy gradient
     (mode none: every weight 1): relative error ||g - g_none|| / ||g_none|| and cosine;
   - and against the on-policy gradient of the fp32 draw with the same keys (its mode none): relative error and
     cosine. Where the bf16 sampler picked other tokens the two draws differ, and no weight can undo that: this is
     the precision's whole effect on the step, the first only what the correction changes.

Prints a line per draw and mode; writes precision.json into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from grpolab.algo.advantages import compute_advantages
from grpolab.algo.engine_correction import CORRECTIONS, engine_weights, mismatch_metrics, mismatch_sums
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


def draw(args) -> tuple:
    """The checkpoint's policy (fp32) and, per dtype, each probe prompt's group: (batch, sampler log-probs,
    rewards), the same keys in both."""
    reward = RewardSection(reward_fn=tuple(args.reward_fn)) if args.reward_fn else RewardSection()
    cfg = RankConfig(
        checkpoint=args.model, data=args.data, reward=reward, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, prompts=args.prompts, group_sizes=(args.group_size,), seed=args.seed,
    )  # fmt: skip
    step, target = run_targets(cfg.checkpoint)[args.step_index]
    task, records, sampler = probe_task(check_intact(target), cfg, NOTHING)
    policy = load_task_policy(target, task, sampler=sampler)
    policy.model.eval()
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
        sums = part if sums is None else {k: (max if k.endswith("max") else sum)((sums[k], part[k])) for k in part}
        logs.append((logp - sampler_logp.double())[batch.completion_mask.bool()])
    d = torch.cat(logs)
    return {"quantiles": {q: float(d.quantile(q)) for q in QUANTILES}, "tokens": d.numel(), **mismatch_metrics(sums)}


def token_weights(groups, trainer, mode: str, cap: float) -> list[torch.Tensor]:
    """d loss / d logp per token ``[G, T]`` of each group: the clip at ratio 1 with the mode's correction weights,
    grpo_std advantages, seq-mean-token-mean over the whole step (groups without reward spread: 0)."""
    N = sum(b.completion_ids.shape[0] for b, _, _ in groups)
    out = []
    for (batch, sampler_logp, rewards), logp in zip(groups, trainer):
        adv = compute_advantages(rewards[None, :].double(), "grpo_std")[0]  # [G]
        w = engine_weights(logp, sampler_logp.double(), batch.completion_mask, mode, cap)  # [G, T]
        out.append(logp_weights(logp, logp, adv, batch.completion_mask, num_seqs=N, token_weights=w))
    return out


def gradient(model, groups, weights, temperature: float) -> torch.Tensor:
    """The step's gradient, flat ``[D]`` float64: sum over groups of grad sum_it w_it log pi(o_it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for (batch, _, _), w in zip(groups, weights):
        if not bool(w.any()):
            continue
        logp = completion_logprobs(model, batch, temperature)
        grads = torch.autograd.grad((logp.double() * w).sum(), params, allow_unused=True)
        for t, g in zip(total, grads):
            if g is not None:
                t += g.double()
    return torch.cat([t.reshape(-1) for t in total])


def ranks(model, groups, weights, temperature: float) -> list[float]:
    """Effective rank of each live group's per-rollout gradient rows sum_t w_it grad log pi(o_it)."""
    out = []
    for (batch, _, rewards), w in zip(groups, weights):
        if bool((rewards != rewards[0]).any()):
            psi = score_gram(model, batch, w, temperature=temperature)
            out.append(
                spectrum_metrics(singular_values_from_gram(psi, torch.ones(psi.shape[0]).double()))["effective_rank"]
            )
    return out


def compare(g: torch.Tensor, ref: torch.Tensor) -> dict:
    """Relative error ||g - ref|| / ||ref|| and cosine."""
    n = float(ref.norm())
    return {"rel_error": float((g - ref).norm()) / n, "cosine": float(g @ ref) / (float(g.norm()) * n)}


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
    p.add_argument("--out", default="runs/precision")
    args = p.parse_args()
    set_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    policy, step, groups = draw(args)
    model, T = policy.model, args.temperature
    results: dict = {"args": vars(args), "step": step, "draws": {}}
    reference = None
    for dtype in DRAWS:
        with torch.no_grad():
            trainer = [completion_logprobs(model, b, T).double() for b, _, _ in groups[dtype]]
        live = sum(bool((r != r[0]).any()) for _, _, r in groups[dtype])
        summary = {"live_groups": live, "log_ratio": log_ratio_summary(groups[dtype], trainer), "modes": {}}
        q = summary["log_ratio"]["quantiles"]
        print(f"step {step} {dtype}: {live} of {args.prompts} groups with reward spread; log r quantiles "
              + " ".join(f"{k:g}:{v:+.2e}" for k, v in q.items())
              + f"; outside [0.9, 1.1] {summary['log_ratio']['engine/ratio_outside_frac']:.4f}", flush=True)  # fmt: skip
        on_policy = None
        for mode in CORRECTIONS:
            w = token_weights(groups[dtype], trainer, mode, args.cap)
            g = gradient(model, groups[dtype], w, T)
            on_policy = g if mode == "none" else on_policy
            reference = g if mode == "none" and dtype == "float32" else reference
            row = {"rank": mean_ci(ranks(model, groups[dtype], w, T)), "same_rollouts": compare(g, on_policy)}
            row["vs_fp32_draw"] = compare(g, reference)
            summary["modes"][mode] = row
            r, s, f = row["rank"], row["same_rollouts"], row["vs_fp32_draw"]
            print(f"  {mode:<18} rank {r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]  vs same rollouts: rel {s['rel_error']:.2e}"
                  f" cos {s['cosine']:.6f}  vs fp32 draw: rel {f['rel_error']:.3f} cos {f['cosine']:.4f}", flush=True)  # fmt: skip
        results["draws"][dtype] = summary
    results["seconds"] = time.perf_counter() - t0
    (out / "precision.json").write_text(json.dumps(results, indent=2))
    print(f"{out / 'precision.json'} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
