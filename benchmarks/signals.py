"""Does GRPO's gradient rank fall with the reward spread, and does it (or the spread) announce saturation?
[Foundations, Sec. 8, questions 2 and 3] on SmolLM2-135M-Instruct and the last-letter task.

One `grpolab train` run per seed (two at a time with --jobs 2) with the online spectrum probe every --every steps
on every group of the step (--probe-groups 8): each group's effective rank at its own size G = 8 and at G = 4 (each
half of the group is a group of 4: the rollouts are i.i.d.), its rewards' spread, and the held-out accuracy every
--every steps. Then, from the runs' metrics.jsonl and probe.jsonl:

1. The fit of each measured group's effective rank against its advantages' own effective rank (sum |A|)^2 / sum A^2,
   which for rewards in {0, 1} is 4 G p (1 - p) = 4 G sigma^2 (the rank the matrix would have if the groups' score
   vectors were orthonormal): slope, intercept and correlation with bootstrap intervals over groups.
2. The saturation point of each run, by a rule fixed before the runs were looked at: the first evaluation step whose
   greedy held-out accuracy reaches acc_0 + 0.9 (acc_max - acc_0), acc_max the largest over the run. Each signal's
   onset: the first probe step at which it has moved half of the way from its first value to its extreme over the
   run (effective rank and sigma_r falling, frac_zero_std rising). Lead = saturation step - onset (> 0: the signal
   came first), mean over seeds with a t interval.

    python benchmarks/signals.py --out runs/signals [--seeds 0,1,2] [--steps 36] [--every 3] [--jobs 2]

Runs already finished in --out are reused (delete a run directory to redo it). Writes summary.json and signals.png
into --out.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from grpolab.probes.signals import onset, saturation_step

ROOT = Path(__file__).resolve().parents[1]
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
"""Student's t quantile 0.975 by degrees of freedom: intervals over a few seeds."""


def train_command(out: Path, seed: int, steps: int, every: int, data: Path) -> list[str]:
    return [
        sys.executable, "-m", "grpolab", "train", "--model", "smollm2-135m-instruct",
        "--data", str(data / "train.parquet"), "--eval-data", str(data / "test.parquet"),
        "--reward-fn", str(ROOT / "examples/last_letter/reward.py") + ":last_letter",
        "--temperature", "0.7", "--max-new-tokens", "16", "--prompts-per-step", "8", "--group-size", "8",
        "--lr", "1e-5", "--warmup-steps", "2", "--steps", str(steps), "--eval-every", str(every),
        "--eval-questions", "100", "--eval-samples", "1", "--probe-every", str(every), "--probe-groups", "8",
        "--save-every", "100000", "--seed", str(seed), "--threads", "1", "--no-progress", "--out", str(out),
    ]  # fmt: skip


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t interval over a few values (seeds)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan"), float("nan")
    half = T975[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def fit(xs: list[float], ys: list[float], boot: int = 2000, seed: int = 0) -> dict:
    """Least-squares y = a + b x and Pearson r, each with a 95% bootstrap interval over the points."""

    def once(idx):
        x = [xs[i] for i in idx]
        y = [ys[i] for i in idx]
        mx, my = statistics.fmean(x), statistics.fmean(y)
        sxx = sum((v - mx) ** 2 for v in x)
        syy = sum((v - my) ** 2 for v in y)
        sxy = sum((u - mx) * (v - my) for u, v in zip(x, y))
        b = sxy / sxx if sxx else float("nan")
        r = sxy / math.sqrt(sxx * syy) if sxx and syy else float("nan")
        return my - b * mx, b, r

    n = len(xs)
    a, b, r = once(range(n))
    rng = random.Random(seed)
    draws = [once([rng.randrange(n) for _ in range(n)]) for _ in range(boot)]

    def ci(k):
        v = sorted(d[k] for d in draws if not math.isnan(d[k]))
        return [v[int(0.025 * len(v))], v[int(0.975 * len(v)) - 1]]

    return {"n": n, "intercept": a, "intercept_ci": ci(0), "slope": b, "slope_ci": ci(1), "r": r, "r_ci": ci(2)}


def analyse(runs: dict[int, Path]) -> dict:
    per_seed, groups = {}, []
    for seed, run in runs.items():
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        probe = [json.loads(line) for line in (run / "probe.jsonl").read_text().splitlines()]
        groups += probe
        evals = [(r["step"], r["eval/accuracy_greedy"]) for r in rows if r.get("eval/accuracy_greedy") is not None]
        probed = [r for r in rows if r.get("probe/groups_measured") is not None]
        signals = {
            name: [(r["step"], r[key]) for r in probed if r.get(key) is not None]
            for name, key in (
                ("eff_rank", "probe/eff_rank"),
                ("eff_rank_half", "probe/eff_rank_half"),
                ("sigma_r", "reward/group_std_mean"),
                ("frac_zero_std", "reward/frac_zero_std"),
            )
        }
        sat = saturation_step(evals)
        onsets = {k: onset(v, falling=(k != "frac_zero_std")) for k, v in signals.items()}
        per_seed[seed] = {
            "evals": evals,
            "signals": signals,
            "saturation_step": sat,
            "onset": onsets,
            "lead": {k: (sat - o if o is not None else None) for k, o in onsets.items()},
        }
    leads = {}
    for k in ("eff_rank", "eff_rank_half", "sigma_r", "frac_zero_std"):
        vals = [p["lead"][k] for p in per_seed.values() if p["lead"][k] is not None]
        leads[k] = dict(zip(("mean", "lo", "hi"), t_interval(vals))) | {"n": len(vals)} if vals else None
    full = [g for g in groups if "adv_effective_rank" in g]
    halves = [h for g in full for h in g.get("halves", []) if h["reward_std"] > 0]
    return {
        "per_seed": per_seed,
        "lead": leads,
        "fit_rank_vs_adv_rank_G8": fit([g["adv_effective_rank"] for g in full], [g["effective_rank"] for g in full]),
        "fit_rank_vs_sigma2_G4": fit(
            [4 * 4 * h["reward_std"] ** 2 for h in halves], [h["effective_rank"] for h in halves]
        ),
        "groups": len(full),
    }


def plot(summary: dict, out: Path, task: str = "last letter") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("accuracy", "eff_rank", "eff_rank_half", "sigma_r", "frac_zero_std")
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    for seed, p in summary["per_seed"].items():
        series = {"accuracy": p["evals"], **p["signals"]}
        for ax, k in zip(axes, keys):
            pts = [(s, v) for s, v in series[k] if v is not None]
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", ms=3, label=f"seed {seed}")
            ax.axvline(p["saturation_step"], ls=":", lw=0.8, color=ax.lines[-1].get_color())
    for ax, k in zip(axes, keys):
        ax.set_title({"accuracy": "held-out greedy accuracy", "eff_rank_half": "eff_rank at G = 4"}.get(k, k))
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M-Instruct, {task}; dotted: saturation step (rule fixed in advance)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "signals.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/signals")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=36)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2)
    ns = ap.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    if not (data / "test.parquet").is_file():
        subprocess.run(
            [sys.executable, str(ROOT / "examples/last_letter/make_data.py"), "--out", str(data)], check=True
        )
    runs = {int(s): out / f"seed{s}" for s in ns.seeds.split(",")}

    def one(seed):
        run = runs[seed]
        if (run / "probe.jsonl").is_file() and (run / "checkpoints").is_dir():
            return 0.0
        t0 = time.perf_counter()
        with open(out / f"seed{seed}.log", "w") as log:
            subprocess.run(train_command(run, seed, ns.steps, ns.every, data), stdout=log, stderr=log, check=True)
        return time.perf_counter() - t0

    with ThreadPoolExecutor(ns.jobs) as pool:
        for seed, wall in zip(runs, pool.map(one, runs)):
            print(f"seed {seed}: {wall:.0f} s" if wall else f"seed {seed}: reused")
    summary = analyse(runs)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out)
    print(json.dumps({k: summary[k] for k in ("lead", "fit_rank_vs_adv_rank_G8", "fit_rank_vs_sigma2_G4")}, indent=2))
    print(f"wrote {out}/summary.json and {out}/signals.png")


if __name__ == "__main__":
    main()
