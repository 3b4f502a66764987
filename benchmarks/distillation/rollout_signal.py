"""How much one rollout teaches under GRPO, on-policy distillation (OPD) and their mix, from one student and one
teacher at step 0: the estimator MSE per rollout against each one's own target, the spectrum of the per-rollout
gradient rows, the groups that move no weight, and whether the teacher's direction fights the reward's.

For each of --prompts prompts, a pool of --pool rollouts of the student (the probe's seeded draw, scored by the task's
reward). Per rollout, exact D-dimensional gradients in float64 (grpolab.probes.distill_signal's notation): the score
psi, rkl-reward's k1 row a, k3's row b, and the exact reverse-KL gradient over the whole vocabulary at the rollout's
prefixes e (what --distill-loss rkl backpropagates). Then, per prompt, from the pool's Gram blocks:

- GRPO (group-mean baseline): MSE at G about mu_R = E[(r - v) psi] (grpolab.probes.mse.prompt_moments);
- OPD k1 and k3: MSE at G about mu_KL = E e; the exact per-prefix gradient e's own MSE (the prefixes' noise alone);
- the mix (lambda = --coef): MSE about mu_R - lambda mu_KL (grpolab.probes.distill_signal.mix_mse);
- cos(mu_R, -mu_KL): the two ascent directions, pooled over prompts; negative where the teacher fights the reward.

MSEs are reported relative to the target's squared norm, summed over prompts (sum MSE / sum ||target||^2), with 95%
bootstrap intervals over prompts. The spectrum: the rows of the first G rollouts of every prompt (GRPO: A_i psi_i with
grpo_std advantages; OPD: -a_i; mix: both), their effective rank and top-1 energy (grpolab.probes.spectrum).

    python benchmarks/distillation/rollout_signal.py --teacher runs/demo/checkpoints/step_500 --prompts 16 --pool 16 -G 8
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import time
from pathlib import Path

import torch

from grpolab.algo.advantages import compute_advantages
from grpolab.analysis.pool import probe_sampler
from grpolab.analysis.rank import RankConfig
from grpolab.common import streams
from grpolab.common.given import NOTHING
from grpolab.common.rng import set_threads
from grpolab.common.stats import percentile_interval
from grpolab.eval.runs import check_intact, load_task_policy, probe_task, run_targets
from grpolab.models.logprobs import completion_divergence, completion_hidden, completion_logprobs
from grpolab.models.policy import load_policy
from grpolab.probes.distill_signal import cosine, mean_estimator_mse, mix_mse, off_mean
from grpolab.probes.mse import mse_from_moments
from grpolab.probes.spectrum import singular_values_from_gram, spectrum_metrics


def draw_pools(args):
    """The student, the teacher (float64, frozen) and each prompt's pool: (batch, rewards)."""
    cfg = RankConfig(checkpoint=args.model, prompts=args.prompts, group_sizes=(args.pool,), seed=args.seed,
                     max_new_tokens=args.max_new_tokens)  # fmt: skip
    step, target = run_targets(cfg.checkpoint)[-1]
    task, records, sampler = probe_task(check_intact(target), cfg, NOTHING)
    policy = load_task_policy(check_intact(target), task, sampler=sampler)
    policy.model.eval()
    pools = []
    with contextlib.closing(probe_sampler(policy, task, "hf", print, records)) as draw:
        for k, record in enumerate(records[: args.prompts]):
            pools.append(draw(record, args.pool, (streams.PROBE, args.seed, step, k))[:2])
    teacher = load_policy(args.teacher, torch.float64).model.eval().requires_grad_(False)
    return policy.model.double(), teacher, pools


def rollout_vectors(model, teacher, row) -> dict[str, torch.Tensor]:
    """One rollout's gradients ``[D]`` each (float64): psi, a (k1), b (k3), e (exact reverse KL)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def flat(loss) -> torch.Tensor:
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params, retain_graph=True)])

    mask = row.completion_mask.double()
    logp = completion_logprobs(model, row)  # [1, T]
    with torch.no_grad():
        t_logp = completion_logprobs(teacher, row)
        k1 = (logp - t_logp) * mask
        log_r = (t_logp - logp) * mask
        k3 = (torch.exp(log_r) - log_r - 1.0) * mask
        hidden = completion_hidden(teacher, row)
    div = completion_divergence(model, row, hidden, teacher.get_output_embeddings(), 1.0)[..., 1]
    return {
        "psi": flat((logp * mask).sum()),
        "a": flat((k1 * logp).sum()),
        "b": flat((k3 * logp).sum()),
        "e": flat(div.sum()),
    }


def prompt_figures(vec: dict[str, torch.Tensor], rewards: torch.Tensor, G: int, lam: float, subsets) -> dict:
    """One pool's MSEs at G and target norms, from its Gram blocks."""
    psi, a, b, e = vec["psi"], vec["a"], vec["b"], vec["e"]
    blocks = {"PP": psi @ psi.T, "PA": psi @ a.T, "AA": a @ a.T, "PE": psi @ e.T, "EE": e @ e.T}
    mix = mix_mse(blocks, rewards, lam, subsets)
    m = mix["moments"]
    return {
        "grpo": (mse_from_moments(m, "grpo", G), m["mu2"]),
        "k1": (mean_estimator_mse(blocks["AA"], a @ e.T, blocks["EE"], G), off_mean(blocks["EE"])),
        "k3": (mean_estimator_mse(b @ b.T, b @ e.T, blocks["EE"], G), off_mean(blocks["EE"])),
        "exact": (mean_estimator_mse(blocks["EE"], blocks["EE"], blocks["EE"], G), off_mean(blocks["EE"])),
        "mix": (mix["mse"], mix["target2"]),
        "cos": cosine(-mix["cross"], mix["mu2_R"], mix["mu2_KL"]),
        "parts": (-mix["cross"], mix["mu2_R"], mix["mu2_KL"]),
    }


def _ratio(pairs: list[tuple[float, float]], seed: int = 0) -> list[float]:
    """sum MSE / sum target^2 over prompts, with its 95% bootstrap interval (prompts resampled)."""
    n = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    d = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    idx = torch.randint(len(pairs), (2000, len(pairs)), generator=torch.Generator().manual_seed(seed))
    lo, hi = percentile_interval((n[idx].sum(1) / d[idx].sum(1)).tolist())
    return [float(n.sum() / d.sum()), lo, hi]


def pooled_cosine(parts: list[tuple[float, float, float]], seed: int = 0) -> list[float]:
    """sum_x <mu_R, -mu_KL> / sqrt(sum_x ||mu_R||^2 sum_x ||mu_KL||^2) over prompts x (one prompt's cosine, whose
    norms are small noisy estimates, can leave [-1, 1]), with its 95% bootstrap interval (prompts resampled)."""
    t = torch.tensor(parts, dtype=torch.float64)  # [P, 3]
    idx = torch.randint(len(parts), (2000, len(parts)), generator=torch.Generator().manual_seed(seed))

    def cos(rows: torch.Tensor) -> torch.Tensor:
        s = rows.sum(dim=-2)
        return s[..., 0] / (s[..., 1].clamp(min=1e-300) * s[..., 2].clamp(min=1e-300)).sqrt()

    lo, hi = percentile_interval(cos(t[idx]).tolist())
    return [float(cos(t)), lo, hi]


def spectra(rows: dict[str, list[torch.Tensor]]) -> dict:
    """Effective rank and top-1 energy of each method's per-rollout rows (all prompts together)."""
    out = {}
    for name, vs in rows.items():
        X = torch.stack(vs)  # [R, D]
        s = singular_values_from_gram(X @ X.T, torch.ones(X.shape[0], dtype=torch.float64))
        out[name] = {k: v for k, v in spectrum_metrics(s).items() if k in ("effective_rank", "top1_fraction")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin", help="the student (a run, a checkpoint, or builtin)")
    ap.add_argument("--teacher", required=True, help="the teacher (a model directory)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--pool", type=int, default=16, help="rollouts a prompt (>= G, <= 20)")
    ap.add_argument("-G", type=int, default=8, help="the group size the MSEs are taken at")
    ap.add_argument("--coef", type=float, default=1.0, help="lambda of the mix")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="write the figures here as JSON")
    args = ap.parse_args()
    set_threads(0)
    t0 = time.perf_counter()
    model, teacher, pools = draw_pools(args)
    subsets = torch.tensor(list(itertools.combinations(range(args.pool), args.G)))
    per, rows, dead = [], {"grpo": [], "opd": [], "mix": []}, 0
    for batch, rewards in pools:
        vec = {k: [] for k in ("psi", "a", "b", "e")}
        for i in range(batch.completion_ids.shape[0]):
            for k, v in rollout_vectors(model, teacher, batch.rows(i, i + 1)).items():
                vec[k].append(v)
        vec = {k: torch.stack(v) for k, v in vec.items()}  # [N, D]
        per.append(prompt_figures(vec, rewards.double(), args.G, args.coef, subsets))
        first = rewards[None, : args.G].double()  # the group the step would train on: the first G
        adv = compute_advantages(first, "grpo_std")[0]  # [G]
        dead += int(bool((adv == 0).all()))
        for i in range(args.G):
            rows["grpo"].append(adv[i] * vec["psi"][i])
            rows["opd"].append(-vec["a"][i])
            rows["mix"].append(adv[i] * vec["psi"][i] - args.coef * vec["a"][i])
    report = {
        "relative_mse": {k: _ratio([p[k] for p in per]) for k in ("grpo", "k1", "k3", "exact", "mix")},
        "cos_reward_teacher": pooled_cosine([p["parts"] for p in per]),
        "cos_median_per_prompt": float(torch.tensor([p["cos"] for p in per if p["cos"] == p["cos"]]).median()),
        "dead_groups": dead / len(pools),
        "spectrum": spectra(rows),
        "prompts": len(pools), "pool": args.pool, "G": args.G, "seconds": time.perf_counter() - t0,
    }  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
