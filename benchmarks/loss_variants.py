"""Loss variants side by side on the built-in task, all with mu = 2 (two updates per batch, so that the ratios move
away from 1 and the objectives differ): token vs sequence (GSPO) importance ratios, with vs without
--mask-truncated, and the policy terms TRL added (--loss-type cispo, sapo, luspo, vespo, each with the aggregation
TRL gives it), GDPO's --reward-normalisation normalize-then-sum (the built-in reward is accuracy + 0.1 format) and
the adaptive entropy bonus.

One `grpolab train` run per (variant, seed) (two at a time with --jobs 2), then `grpolab rank` on each run's
final checkpoint with the variant's own options (the gradient that variant uses). Prints, per variant and
seed, the held-out sampled and greedy accuracy at the end, the share of truncated completions, the mean
token entropy over the last 50 steps, the effective rank of the per-rollout gradient matrix at R = 8 and
the wall time; then the mean over seeds. Writes summary.json into --out.

    python benchmarks/loss_variants.py --out runs/variants [--seeds 0,1] [--steps 300] [--jobs 2]
        [--variants token,sequence,sequence-gspo-clip,mask-truncated,token-mean,cispo,sapo,luspo,vespo,gdpo,entropy]

Runs already finished in --out are reused (delete a run directory to redo it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MU2 = ["--mu", "2"]
# name: train flags. `grpolab rank` takes the options that change the gradient it measures (--mask-truncated)
# from the run's config.json; the importance ratio is 1 at the probe (on-policy), where GSPO's gradient is GRPO's.
VARIANTS: dict[str, list[str]] = {
    "token": MU2,
    "sequence": MU2 + ["--importance-sampling", "sequence"],
    "sequence-gspo-clip": MU2 + ["--importance-sampling", "sequence", "--clip-low", "3e-4", "--clip-high", "4e-4"],
    "mask-truncated": MU2 + ["--mask-truncated"],
    "token-mean": MU2 + ["--aggregation", "token-mean"],  # TRL's default loss_type, dapo
    "cispo": MU2 + ["--loss-type", "cispo", "--aggregation", "token-mean"],
    "sapo": MU2 + ["--loss-type", "sapo"],
    "luspo": MU2 + ["--loss-type", "luspo", "--importance-sampling", "sequence"],
    "vespo": MU2 + ["--loss-type", "vespo", "--aggregation", "token-mean"],
    "gdpo": MU2 + ["--reward-normalisation", "normalize-then-sum"],
    # the bonus engages once the entropy falls to 0.1 (it starts near 0.3 and ends near 0.12 without it)
    "entropy": MU2 + ["--adaptive-entropy", "--entropy-target", "0.1", "--entropy-coef-delta", "0.002"],
}


def _run(cmd: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, check=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        )
    return time.perf_counter() - t0


def train(out: Path, run: Path, name: str, seed: int, args) -> None:
    """`grpolab train` of the variant at ``seed`` into ``run`` (its log beside it), with its wall time in wall.txt;
    nothing if wall.txt is there already."""
    wall_file = run / "wall.txt"
    if wall_file.exists():
        return
    subprocess.run(["rm", "-rf", str(run)], check=True)
    wall = _run(
        [
            sys.executable,
            "-m",
            "grpolab",
            "train",
            "--nproc",
            "1",
            "--out",
            str(run),
            "--seed",
            str(seed),
            "--steps",
            str(args.steps),
            "--eval-every",
            str(args.eval_every),
            "--save-every",
            str(args.steps),
            "--no-progress",
            *VARIANTS[name],
        ],
        out / f"{run.name}.log",
    )
    wall_file.write_text(f"{wall:.1f}")


def rank(out: Path, run: Path, args) -> Path:
    """`grpolab rank` on the run's final checkpoint, unless its rank.json is there already; the folder it writes."""
    rank_dir = run / "probes" / "rank"
    if not (rank_dir / "rank.json").exists():
        _run(
            [
                sys.executable,
                "-m",
                "grpolab",
                "rank",
                "--checkpoint",
                str(run),
                "--steps",
                str(args.steps),
                "--group-sizes",
                "8",
                "--prompts",
                str(args.rank_prompts),
                "--out",
                str(rank_dir),
                "--no-progress",
            ],
            out / f"{run.name}-rank.log",
        )
    return rank_dir


def figures(run: Path, rank_dir: Path, args) -> dict:
    """The run's last held-out accuracies, its means over the last 50 steps, its rank and its wall time."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [r for r in rows if "eval/accuracy_sampled" in r][-1]
    tail = [r for r in rows if r["step"] > args.steps - 50 and "policy/entropy" in r]
    rank = json.loads((rank_dir / "rank.json").read_text())["results"][0]
    return {
        "sampled": last["eval/accuracy_sampled"],
        "greedy": last["eval/accuracy_greedy"],
        "truncated_frac": statistics.fmean(r["completion/truncated_frac"] for r in tail),
        "entropy": statistics.fmean(r["policy/entropy"] for r in tail),
        "clip_frac": statistics.fmean(r["loss/clip_frac"] for r in tail if r.get("loss/clip_frac") is not None),
        "effective_rank": rank["effective_rank"]["mean"],
        "effective_rank_lo": rank["effective_rank"]["lo"],
        "effective_rank_hi": rank["effective_rank"]["hi"],
        "wall_s": float((run / "wall.txt").read_text()),
    }


def one(out: Path, name: str, seed: int, args) -> dict:
    """One (variant, seed): its run trained and ranked (or reused), and its figures."""
    run = out / f"{name}-seed{seed}"
    train(out, run, name, seed, args)
    rank_dir = rank(out, run, args)
    return {"variant": name, "seed": seed, **figures(run, rank_dir, args)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/variants")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--rank-prompts", type=int, default=32)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(v, int(s)) for v in args.variants.split(",") for s in args.seeds.split(",")]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda j: one(out, j[0], j[1], args), jobs))
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    print(
        f"{'variant':<20} {'seed':>4} {'sampled':>8} {'greedy':>7} {'trunc':>6} {'entropy':>8} {'clip':>6} "
        f"{'eff. rank R=8 [95%]':>22} {'wall':>6}"
    )
    for r in results:
        print(
            f"{r['variant']:<20} {r['seed']:>4} {r['sampled']:>8.3f} {r['greedy']:>7.3f} {r['truncated_frac']:>6.3f} "
            f"{r['entropy']:>8.3f} {r['clip_frac']:>6.3f} {r['effective_rank']:>7.2f} [{r['effective_rank_lo']:.2f}, "
            f"{r['effective_rank_hi']:.2f}] {r['wall_s']:>5.0f}s"
        )
    print(f"\nper variant, mean over seeds [95% t interval]; minus {results[0]['variant']} (paired by seed)")
    base = {r["seed"]: r for r in results if r["variant"] == results[0]["variant"]}
    for v in dict.fromkeys(r["variant"] for r in results):
        rs = [r for r in results if r["variant"] == v]
        diff = [r["sampled"] - base[r["seed"]]["sampled"] for r in rs if r["seed"] in base]
        print(
            f"{v:<20} sampled {_mean_ci([r['sampled'] for r in rs])}  greedy {_mean_ci([r['greedy'] for r in rs])}  "
            f"eff. rank {_mean_ci([r['effective_rank'] for r in rs])}  sampled minus base {_mean_ci(diff)}"
        )


def _mean_ci(xs: list[float]) -> str:
    """The mean and its 95% t interval (two-sided) over seeds."""
    from grpolab.analysis.sweep import T975

    m = statistics.fmean(xs)
    if len(xs) < 2:
        return f"{m:.3f}"
    half = T975[len(xs) - 1] * statistics.stdev(xs) / len(xs) ** 0.5
    return f"{m:.3f} [{m - half:.3f}, {m + half:.3f}]"


if __name__ == "__main__":
    main()
