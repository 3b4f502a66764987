"""--sampling fixed|filter|adaptive at an equal rollout budget: held-out accuracy against rollouts generated.

Trains one run per (mode, seed) with ``grpolab train`` (two at a time with ``--jobs 2``), each
until it has generated the budget of ``--steps`` fixed steps (B * G * steps rollouts; filter
generates more per step, so it runs fewer steps, stopped by --max-rollouts), evaluating every
``--eval-every`` steps. Then, per mode: the mean sampled (and greedy) accuracy over seeds on a
common grid of rollouts (each seed's curve interpolated linearly), with a 95% t-interval
over seeds; the rollouts at which the mode's mean curve first reaches fixed's final mean
sampled accuracy, as a share of fixed's; wall time per run. With one seed the intervals are each
evaluation's own (over questions). Writes summary.json and
sampling.png into --out.

    python benchmarks/sampling_budget.py --out runs/sampling-builtin [--seeds 0,1,2] [--steps 500]
        [--eval-every 25] [--jobs 2] [-- extra grpolab train flags]

Runs already finished in --out are reused (delete a run directory to redo it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

MODES = ("fixed", "filter", "adaptive")
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train(run: Path, mode: str, seed: int, args, extra: list[str]) -> float:
    """Runs one training (unless finished); returns its wall seconds (read back from wall.txt when reused)."""
    wall_file = run / "wall.txt"
    if wall_file.exists():
        return float(wall_file.read_text())
    if run.exists():
        subprocess.run(["rm", "-rf", str(run)], check=True)
    budget = args.steps * args.rollouts_per_step
    cmd = [
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
        "--sampling",
        mode,
        "--steps",
        str(args.steps * (4 if mode == "filter" else 1)),
        "--max-rollouts",
        str(budget),
        "--eval-every",
        str(args.eval_every),
        "--save-every",
        str(10**6),
        "--no-progress",
        *extra,
    ]
    t0 = time.perf_counter()
    with open(run.parent / f"{run.name}.log", "w") as log:
        subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, check=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        )
    wall = time.perf_counter() - t0
    wall_file.write_text(f"{wall:.1f}")
    return wall


def curve(run: Path, key: str) -> tuple[np.ndarray, np.ndarray]:
    rows = [r for r in _rows(run) if key in r]
    x = np.array([r.get("sampling/rollouts_total", 0) if r["step"] else 0 for r in rows], dtype=float)
    return x, np.array([r[key] for r in rows])


def summarise(out: Path, seeds: list[int], walls: dict) -> dict:
    grid = None
    summary = {"modes": {}}
    for mode in MODES:
        runs = [out / f"{mode}-seed{s}" for s in seeds]
        if not all((r / "metrics.jsonl").exists() for r in runs):
            continue
        if grid is None:  # fixed's evaluation points
            grid = curve(runs[0], "eval/accuracy_sampled")[0]
        entry = {"wall_s": [walls.get((mode, s)) for s in seeds]}
        for key in ("eval/accuracy_sampled", "eval/accuracy_greedy"):
            ys = np.stack([np.interp(grid, *curve(r, key)) for r in runs])  # [seeds, grid]
            mean = ys.mean(0)
            if len(seeds) > 1:  # t-interval over seeds
                half = T95.get(len(seeds) - 1, 1.96) * ys.std(0, ddof=1) / math.sqrt(len(seeds))
                lo, hi = mean - half, mean + half
            else:  # one seed: the evaluation's own interval over questions
                lo, hi = (
                    np.interp(grid, curve(runs[0], key)[0], curve(runs[0], key + suffix)[1])
                    for suffix in ("_lo", "_hi")
                )
            entry[key] = {
                "rollouts": grid.tolist(),
                "mean": mean.tolist(),
                "lo": lo.tolist(),
                "hi": hi.tolist(),
                "final_per_seed": ys[:, -1].tolist(),
            }
            if len(seeds) == 1:  # the run's own evaluations, for the plot (no interpolated points)
                (x, y), (_, ylo), (_, yhi) = (curve(runs[0], key + sfx) for sfx in ("", "_lo", "_hi"))
                entry[key]["own"] = {"rollouts": x.tolist(), "mean": y.tolist(), "lo": ylo.tolist(), "hi": yhi.tolist()}
        entry["rollouts_total"] = [int(_rows(r)[-1]["sampling/rollouts_total"]) for r in runs]
        entry["steps"] = [int(_rows(r)[-1]["step"]) for r in runs]
        summary["modes"][mode] = entry
    if "fixed" in summary["modes"]:
        target = summary["modes"]["fixed"]["eval/accuracy_sampled"]["mean"][-1]
        budget = grid[-1]
        summary["fixed_final_sampled"] = target
        for entry in summary["modes"].values():
            e = entry["eval/accuracy_sampled"]
            reach = next((i for i, m in enumerate(e["mean"]) if m >= target), None)
            if reach is None:
                entry["rollouts_to_fixed_final"] = None
            elif reach == 0:
                entry["rollouts_to_fixed_final"] = float(grid[0])
            else:  # linear interpolation between the grid points around the crossing
                m0, m1 = e["mean"][reach - 1], e["mean"][reach]
                entry["rollouts_to_fixed_final"] = float(
                    grid[reach - 1] + (target - m0) / (m1 - m0) * (grid[reach] - grid[reach - 1])
                )
            r = entry["rollouts_to_fixed_final"]
            entry["share_of_fixed_budget"] = None if r is None else r / budget
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def plot(summary: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, name in zip(axes, ("eval/accuracy_sampled", "eval/accuracy_greedy"), ("sampled", "greedy")):
        for mode, entry in summary["modes"].items():
            e = entry[key].get("own", entry[key])
            x = np.array(e["rollouts"]) / 1000
            (line,) = ax.plot(x, e["mean"], label=mode, marker=".")
            ax.fill_between(x, e["lo"], e["hi"], alpha=0.2, color=line.get_color())
        if key == "eval/accuracy_sampled" and "fixed_final_sampled" in summary:
            ax.axhline(summary["fixed_final_sampled"], color="grey", lw=0.8, ls="--")
        ax.set_xlabel("rollouts generated (thousands)")
        ax.set_ylabel(f"held-out {name} accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / "sampling.png", dpi=120)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=500, help="fixed's steps; the budget is steps * B * G rollouts")
    p.add_argument("--rollouts-per-step", type=int, default=128, help="B * G of the runs (128: the built-in default)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [(m, s) for s in seeds for m in args.modes.split(",")]
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {job: pool.submit(train, out / f"{job[0]}-seed{job[1]}", job[0], job[1], args, extra) for job in jobs}
        walls = {job: f.result() for job, f in futures.items()}
    summary = summarise(out, seeds, walls)
    plot(summary, out, args.title or f"--sampling at an equal budget ({len(seeds)} seeds, 95% intervals over seeds)")
    print(f"fixed's final sampled accuracy: {summary.get('fixed_final_sampled', float('nan')):.3f}")
    for mode, e in summary["modes"].items():
        fin = e["eval/accuracy_sampled"]
        share = e.get("share_of_fixed_budget")
        print(
            f"{mode:<9} final sampled {fin['mean'][-1]:.3f} [{fin['lo'][-1]:.3f}, {fin['hi'][-1]:.3f}]  "
            f"greedy {e['eval/accuracy_greedy']['mean'][-1]:.3f}  steps {e['steps']}  rollouts {e['rollouts_total']}  "
            f"reaches fixed's final at {'never' if share is None else f'{share:.0%} of the budget'}  "
            f"wall {[round(w) for w in e['wall_s']]} s"
        )
    print(f"wrote {out / 'summary.json'} and {out / 'sampling.png'}")


if __name__ == "__main__":
    main()
