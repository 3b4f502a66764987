"""PNG plots of the probes (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from grpolab.report.plotting import save_figure  # noqa: E402


def plot_rank(results: list[dict], out_dir: str | Path) -> list[Path]:
    """Effective rank and top-1 fraction against training step per R [Foundations, Figures 1-2],
    and the mean reward std per step."""
    out_dir = Path(out_dir)
    paths = []
    panels = (
        ("effective_rank", "effective rank of G", "rank_effective.png"),
        ("top1_fraction", "top-1 fraction s_1^2 / sum s^2", "rank_top1.png"),
    )
    for key, title, name in panels:
        fig, ax = plt.subplots(figsize=(6, 4))
        for R in sorted({r["R"] for r in results}):
            rs = [r for r in results if r["R"] == R and r[key]["mean"] is not None]
            steps = [r["step"] for r in rs]
            mean = [r[key]["mean"] for r in rs]
            # the 95% interval of the mean over prompts (none drawn where a step had one live prompt)
            lo = [m - r[key]["lo"] if r[key].get("lo") is not None else 0.0 for m, r in zip(mean, rs)]
            hi = [r[key]["hi"] - m if r[key].get("hi") is not None else 0.0 for m, r in zip(mean, rs)]
            ax.errorbar(steps, mean, yerr=[lo, hi], marker="o", capsize=3, label=f"R = {R}")
        ax.set_xlabel("training step")
        ax.set_title(title + "\n(mean over prompts with reward variance, 95% interval)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        save_figure(fig, out_dir / name, dpi=100)
        paths.append(out_dir / name)
    fig, ax = plt.subplots(figsize=(6, 4))
    for R in sorted({r["R"] for r in results}):
        rs = [r for r in results if r["R"] == R]
        ax.plot([r["step"] for r in rs], [r["reward_std_mean"] for r in rs], marker="o", label=f"R = {R}")
    ax.set_xlabel("training step")
    ax.set_title("mean within-group reward std", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, out_dir / "rank_reward_std.png", dpi=100)
    paths.append(out_dir / "rank_reward_std.png")
    return paths


ESTIMATOR_COLOURS = {"vanilla": "tab:blue", "grpo": "tab:orange", "rloo": "tab:red", "oracle": "tab:green"}


def plot_mse(report: dict, path: str | Path) -> Path:
    """MSE against G, one panel per policy, one line per estimator with its 95% band [U-statistic, Figure 4]."""
    entries = report["policies"]
    fig, axes = plt.subplots(1, len(entries), figsize=(4.6 * len(entries), 4), squeeze=False, sharey=True)
    for ax, entry in zip(axes[0], entries):
        for est, colour in ESTIMATOR_COLOURS.items():
            rs = sorted((r for r in entry["results"] if r["estimator"] == est), key=lambda r: r["G"])
            if not rs:
                continue
            G = [r["G"] for r in rs]
            ax.plot(G, [r["mse"] for r in rs], marker="o", color=colour, label=est)
            ax.fill_between(
                G, [max(r["ci_low"], 1e-30) for r in rs], [r["ci_high"] for r in rs], color=colour, alpha=0.15
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("group size G")
        ax.set_title(
            f"{Path(entry['policy']).name or entry['policy']}\nmean reward {entry['reward_mean']:.2f}", fontsize=9
        )
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("MSE of the gradient estimate (per prompt)")
    axes[0][0].legend(fontsize=8)
    return save_figure(fig, path, dpi=110)


def plot_groupsize(report: dict, path: str | Path) -> Path:
    """Predicted rloo MSE against G at the fixed budget, with the bootstrap band and G*."""
    curve = report["curve"]
    G = [c["G"] for c in curve]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(G, [c["mse"] for c in curve], marker="o", label="predicted MSE")
    ax.fill_between(
        G, [c["ci"][0] for c in curve], [min(c["ci"][1], 1e30) for c in curve], alpha=0.2, label="95% bootstrap band"
    )
    g_star = report["g_star"]
    if g_star != float("inf"):
        ax.axvline(g_star, color="k", ls="--", label=f"G* = {g_star:.1f}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"group size G (B = {report['config']['budget']} / G prompts)")
    ax.set_ylabel("predicted MSE (rloo, minibatch)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=110)


def plot_multiturn(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """Bias RMS over histories against stage, one line per estimator (with the exact values when known)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    colours = {"grpo": "tab:orange", "rtg-group": "tab:blue", "rtg-mc": "tab:green"}
    for est, colour in colours.items():
        rs = sorted((r for r in rows if r["estimator"] == est), key=lambda r: r["stage"])
        h = [r["stage"] for r in rs]
        rms = [r["bias_rms"] for r in rs]
        # a stage with no interval (its episodes from one record) gets no error bar
        err = [
            [0.0 if r["ci_low"] is None else m - r["ci_low"] for m, r in zip(rms, rs)],
            [0.0 if r["ci_high"] is None else r["ci_high"] - m for m, r in zip(rms, rs)],
        ]
        ax.errorbar(h, rms, yerr=err, marker="o", capsize=3, color=colour, label=f"{est} (Monte Carlo, 95% CI)")
        if rs and "bias_rms_exact" in rs[0]:
            ax.plot(h, [r["bias_rms_exact"] for r in rs], ls="--", color=colour, alpha=0.7, label=f"{est} (exact)")
    ax.set_xlabel("stage h")
    ax.set_ylabel("RMS over histories of E[A_hat - A | history]")
    ax.set_xticks(sorted({r["stage"] for r in rows}))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=110)
