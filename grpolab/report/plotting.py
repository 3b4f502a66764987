"""PNG plots of a run's metrics (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from grpolab.training.runlog import read_metrics  # noqa: E402


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Lay ``fig`` out, write it to ``path`` and free it: how every figure of grpolab ends."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return Path(path)


def figure_png(fig, dpi: int = 90) -> bytes:
    """Lay ``fig`` out, render it as PNG bytes (for a page that embeds it) and free it."""
    import io

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def running_mean(y: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(y):
        acc += v
        if i >= k:
            acc -= y[i - k]
        out.append(acc / min(i + 1, k))
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None, title: str = "") -> Path:
    """Reward, held-out accuracy and the share of zero-variance groups against step."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    out = Path(out) if out else run_dir / "plot.png"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    k = max(1, len(rows) // 30)

    x, y = _series(rows, "reward/mean")
    axes[0].plot(x, y, color="tab:blue", alpha=0.3, lw=0.8)
    axes[0].plot(x, running_mean(y, k), color="tab:blue", label="reward/mean")
    x, y = _series(rows, "reward/accuracy")
    axes[0].plot(x, running_mean(y, k), color="tab:green", label="reward/accuracy (train rollouts)")
    axes[0].set_title(f"training reward (moving mean over {k} steps)")

    for key, color in (("eval/accuracy_greedy", "tab:red"), ("eval/accuracy_sampled", "tab:purple")):
        x, y = _series(rows, key)
        axes[1].plot(x, y, "o-", color=color, label=key)
        band = [(r["step"], r[key + "_lo"], r[key + "_hi"]) for r in rows if key + "_lo" in r]
        if band:  # 95% intervals (runs logged before intervals existed have none)
            axes[1].fill_between(
                [b[0] for b in band], [b[1] for b in band], [b[2] for b in band], color=color, alpha=0.15
            )
    axes[1].set_title("held-out accuracy (95% intervals)")

    x, y = _series(rows, "reward/frac_zero_std")
    axes[2].plot(x, y, color="tab:gray", alpha=0.3, lw=0.8)
    axes[2].plot(x, running_mean(y, k), color="tab:gray", label="reward/frac_zero_std")
    axes[2].set_title("groups with zero reward variance (no signal)")

    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02 if ax is not axes[0] else None)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    if title:
        fig.suptitle(title)
    return save_figure(fig, out, dpi=100)


def plot_sweep(report: dict, path: str | Path) -> Path:
    """Final held-out accuracy against G at a fixed budget, mean and 95% CI over seeds [U-statistic, Figure 5]."""
    table = report["table"]
    G = [t["G"] for t in table]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, colour in (("sampled", "tab:purple"), ("greedy", "tab:red")):
        mean = [t[key] for t in table]
        err = [
            [m - t[f"{key}_ci"][0] for m, t in zip(mean, table)],
            [t[f"{key}_ci"][1] - m for m, t in zip(mean, table)],
        ]
        ax.errorbar(G, mean, yerr=err, marker="o", capsize=3, color=colour, label=f"eval/accuracy_{key}")
        ax.axhline(report["before"][key], color=colour, ls=":", lw=1)
    if report.get("predicted_g_star", float("inf")) != float("inf"):
        ax.axvline(
            report["predicted_g_star"], color="k", ls="--", label=f"predicted G* = {report['predicted_g_star']:.1f}"
        )
    cfg = report["config"]
    ax.set_xscale("log", base=2)
    ax.set_xticks(G, [str(g) for g in G])
    ax.set_xlabel(f"group size G (B = {cfg['budget']} / G)")
    ax.set_ylabel("held-out accuracy after GRPO")
    ax.set_title(f"{cfg['steps']} steps, {cfg['seeds']} seeds, mean and 95% CI (dotted: before)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=110)


def plot_compare(run_dirs: list[str | Path], keys: list[str], out: str | Path) -> Path:
    """One panel per metric key, one line per run label (directory name without ``-seedN``),
    the mean over that label's seeds with their range shaded."""
    import re

    groups: dict[str, list[list[dict]]] = {}
    for d in run_dirs:
        label = re.sub(r"-seed\d+$", "", Path(d).name)
        groups.setdefault(label, []).append(read_metrics(Path(d) / "metrics.jsonl"))
    fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for label, runs in groups.items():
            series = [dict(zip(*_series(rows, key))) for rows in runs]
            steps = sorted(set.intersection(*(set(s) for s in series)))
            if not steps:
                continue
            vals = [[s[t] for s in series] for t in steps]
            ax.plot(steps, [sum(v) / len(v) for v in vals], marker="o", ms=3, label=f"{label} ({len(runs)} seeds)")
            ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], alpha=0.15)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    return save_figure(fig, out, dpi=110)
