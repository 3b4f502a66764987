"""Training reward against wall time for several runs, on one plot: what a faster sampler buys a run.

    python benchmarks/reward_vs_time.py fp32=runs/letters-fp32 bf16=runs/letters-bf16 [--metric reward/mean]
                                        [--window 5] [--out docs/precision-smollm2.png]

Each run's x axis is its cumulative step time (the sum of ``time/step_s`` over its steps: sampling, scoring, update
and weight sync; evaluation and checkpointing are not in it), so runs that sampled at other speeds line up by what
they cost. Points are the steps' values, lines their running mean over ``--window`` steps. Prints, per run, its
steps, total step time, mean step time and the last evaluation's greedy accuracy with its 95% interval.
"""

from __future__ import annotations

import argparse
from itertools import accumulate
from pathlib import Path

from grpolab.training.runlog import read_metrics


def series(run: Path, metric: str) -> tuple[list[float], list[float]]:
    """(cumulative step time in minutes, ``metric``) over the run's training steps."""
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "time/step_s" in r]
    minutes = [t / 60 for t in accumulate(r["time/step_s"] for r in steps)]
    return minutes, [r[metric] for r in steps]


def running_mean(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def last_eval(run: Path) -> str:
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "eval/accuracy_greedy" in r]
    if not rows:
        return "no evaluation"
    r = rows[-1]
    return f"greedy {r['eval/accuracy_greedy']:.3f} [{r['eval/accuracy_greedy_lo']:.3f}, {r['eval/accuracy_greedy_hi']:.3f}] at step {r['step']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="LABEL=RUN_DIR, one per run")
    parser.add_argument("--metric", default="reward/mean")
    parser.add_argument("--window", type=int, default=5, help="steps in the running mean")
    parser.add_argument("--out", default="reward_vs_time.png")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for spec in args.runs:
        label, _, path = spec.partition("=")
        if not path:
            parser.error(f"{spec!r}: expected LABEL=RUN_DIR")
        run = Path(path)
        x, y = series(run, args.metric)
        (line,) = ax.plot(x, running_mean(y, args.window), label=f"{label} ({args.window}-step mean)")
        ax.scatter(x, y, s=10, alpha=0.4, color=line.get_color())
        print(
            f"{label}: {len(x)} steps, {x[-1]:.2f} min of step time ({60 * x[-1] / len(x):.1f} s a step); {last_eval(run)}"
        )
    ax.set_xlabel("cumulative step time (min)")
    ax.set_ylabel(args.metric)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()
