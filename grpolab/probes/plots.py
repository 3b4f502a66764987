"""PNG plots of the probes (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_rank(results: list[dict], out_dir: str | Path) -> list[Path]:
    """Effective rank and top-1 fraction against training step per R (paper 000, Figures 1-2),
    and the mean reward std per step."""
    out_dir = Path(out_dir)
    paths = []
    panels = (("effective_rank", "effective rank of G", "rank_effective.png"),
              ("top1_fraction", "top-1 energy fraction s_1^2 / sum s^2", "rank_top1.png"))
    for key, title, name in panels:
        fig, ax = plt.subplots(figsize=(6, 4))
        for R in sorted({r["R"] for r in results}):
            rs = [r for r in results if r["R"] == R and r[key]["mean"] is not None]
            steps = [r["step"] for r in rs]
            mean = [r[key]["mean"] for r in rs]
            std = [r[key]["std"] for r in rs]
            ax.errorbar(steps, mean, yerr=std, marker="o", capsize=3, label=f"R = {R}")
        ax.set_xlabel("training step")
        ax.set_title(title + " (mean ± std over prompts with reward variance)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        paths.append(out_dir / name)
    fig, ax = plt.subplots(figsize=(6, 4))
    for R in sorted({r["R"] for r in results}):
        rs = [r for r in results if r["R"] == R]
        ax.plot([r["step"] for r in rs], [r["reward_std_mean"] for r in rs], marker="o", label=f"R = {R}")
    ax.set_xlabel("training step")
    ax.set_title("mean within-group reward std", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "rank_reward_std.png", dpi=100)
    plt.close(fig)
    paths.append(out_dir / "rank_reward_std.png")
    return paths
