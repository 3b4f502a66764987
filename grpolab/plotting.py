"""PNG plots of a run's metrics (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from grpolab.runlog import read_metrics  # noqa: E402


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _smooth(y: list[float], k: int) -> list[float]:
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
    axes[0].plot(x, _smooth(y, k), color="tab:blue", label="reward/mean")
    x, y = _series(rows, "reward/accuracy")
    axes[0].plot(x, _smooth(y, k), color="tab:green", label="reward/accuracy (train rollouts)")
    axes[0].set_title(f"training reward (moving mean over {k} steps)")

    for key, color in (("eval/accuracy_greedy", "tab:red"), ("eval/accuracy_sampled", "tab:purple")):
        x, y = _series(rows, key)
        axes[1].plot(x, y, "o-", color=color, label=key)
    axes[1].set_title("held-out accuracy")

    x, y = _series(rows, "reward/frac_zero_std")
    axes[2].plot(x, y, color="tab:gray", alpha=0.3, lw=0.8)
    axes[2].plot(x, _smooth(y, k), color="tab:gray", label="reward/frac_zero_std")
    axes[2].set_title("groups with zero reward variance (no signal)")

    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02 if ax is not axes[0] else None)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
