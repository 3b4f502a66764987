"""GRPO, on-policy distillation (OPD) and their mix, each at several seeds: held-out accuracy against the rollouts
spent, the rollouts each arm needs to close a share of the gap between student and teacher, and the books that say
why (groups of equal rewards, the share of rollouts that move the weights, the teacher's KL).

Each arm is a set of `grpolab train` runs named ARM_sSEED under --runs (docs/distillation.md gives the commands).
The student's accuracy is the runs' step-0 evaluation; the teacher's is --teacher-acc (its own run's last
evaluation on the same held-out questions). An arm reaches the target at the first evaluation whose sampled
accuracy is at or above student + --share x (teacher - student); a run that never does counts as censored at its
last step (shown with ">").

    python benchmarks/distillation/arms.py --runs runs/distill --teacher-acc 0.375 --plot docs/distillation-arms.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from grpolab.analysis.sweep import mean_ci_t


def read_run(run: Path) -> dict:
    """Evaluations (step, sampled accuracy) and per-step books of one run."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cfg = json.loads((run / "config.json").read_text())
    per_step = cfg["prompts_per_step"] * cfg["group_size"]
    evals = [(r["step"], r["eval/accuracy_sampled"]) for r in rows if "eval/accuracy_sampled" in r]
    train = [r for r in rows if "loss/active_frac" in r]

    def avg(key: str) -> float | None:
        v = [r[key] for r in train if isinstance(r.get(key), int | float)]
        return statistics.fmean(v) if v else None

    return {
        "evals": evals, "rollouts_per_step": per_step, "zero_std": avg("reward/frac_zero_std"),
        "active": avg("loss/active_frac"), "kl_first": next((r["distill/kl"] for r in train if "distill/kl" in r), None),
        "kl_last": next((r["distill/kl"] for r in reversed(train) if "distill/kl" in r), None),
    }  # fmt: skip


def rollouts_to(run: dict, target: float) -> tuple[int, bool]:
    """(rollouts, reached): those spent at the first evaluation at or above ``target``, or at the last one."""
    for step, acc in run["evals"]:
        if acc >= target:
            return step * run["rollouts_per_step"], True
    return run["evals"][-1][0] * run["rollouts_per_step"], False


def table(arms: dict[str, list[dict]], target: float) -> list[str]:
    """One markdown row per arm."""
    lines = [
        "| arm | seeds | rollouts to the target (each seed) | mean [95% t-interval] | final sampled accuracy | "
        "groups all equal | rollouts that move the weights | distill/kl first -> last |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in arms.items():
        hits = [rollouts_to(r, target) for r in runs]
        each = ", ".join(f"{n}" if ok else f">{n}" for n, ok in hits)
        m, lo, hi = mean_ci_t([n for n, _ in hits])
        censored = "" if all(ok for _, ok in hits) else " (censored: a lower bound)"
        finals = mean_ci_t([r["evals"][-1][1] for r in runs])
        kl = [r for r in runs if r["kl_first"] is not None]
        kls = "-"
        if kl:
            kls = (
                f"{statistics.fmean(r['kl_first'] for r in kl):.3f} -> {statistics.fmean(r['kl_last'] for r in kl):.4f}"
            )
        lines.append(
            f"| {name} | {len(runs)} | {each} | {m:.0f} [{lo:.0f}, {hi:.0f}]{censored} | "
            f"{finals[0]:.3f} [{finals[1]:.3f}, {finals[2]:.3f}] | "
            f"{statistics.fmean(r['zero_std'] for r in runs):.2f} | {statistics.fmean(r['active'] for r in runs):.2f} | "
            f"{kls} |"
        )
    return lines


def plot(arms: dict[str, list[dict]], student: float, teacher: float, target: float, path: str) -> None:
    """Sampled accuracy against rollouts, each arm's mean over seeds with its seeds' range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, runs in arms.items():
        steps = sorted(set.intersection(*[{s for s, _ in r["evals"]} for r in runs]))
        accs = [[dict(r["evals"])[s] for r in runs] for s in steps]
        x = [s * runs[0]["rollouts_per_step"] for s in steps]
        ax.plot(x, [statistics.fmean(a) for a in accs], label=f"{name} ({len(runs)} seeds)")
        ax.fill_between(x, [min(a) for a in accs], [max(a) for a in accs], alpha=0.2)
    for y, what in ((student, "student"), (teacher, "teacher"), (target, "target")):
        ax.axhline(y, ls=":", c="grey", lw=1)
        ax.text(0, y, f" {what} {y:.3f}", va="bottom", fontsize=8, color="grey")
    ax.set_xlabel("rollouts spent")
    ax.set_ylabel("held-out sampled accuracy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="directory of ARM_sSEED run directories")
    ap.add_argument("--teacher-acc", type=float, required=True, help="the teacher's held-out sampled accuracy")
    ap.add_argument("--share", type=float, default=0.8, help="share of the student-teacher gap to close")
    ap.add_argument("--plot", default="", help="write the accuracy-against-rollouts plot here")
    args = ap.parse_args()
    arms: dict[str, list[dict]] = {}
    for run in sorted(Path(args.runs).glob("*_s*")):
        if (run / "metrics.jsonl").is_file():
            arms.setdefault(run.name.rsplit("_s", 1)[0], []).append(read_run(run))
    student = statistics.fmean(r["evals"][0][1] for runs in arms.values() for r in runs)
    target = student + args.share * (args.teacher_acc - student)
    print(f"student {student:.3f}, teacher {args.teacher_acc:.3f}, target ({args.share:.0%} of the gap) {target:.3f}")
    print("\n".join(table(arms, target)))
    if args.plot:
        plot(arms, student, args.teacher_acc, target, args.plot)


if __name__ == "__main__":
    main()
