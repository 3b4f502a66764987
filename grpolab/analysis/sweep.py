"""``grpolab sweep``: GRPO at a fixed sampling budget B * G, over group sizes and seeds [U-statistic, Sec. 5.2].

Each (G, seed) is an ordinary ``grpolab train`` run in ``OUT/G{G}-seed{S}`` with
B = budget / G prompts per step; runs go ``--jobs`` at a time in separate processes
(one torch thread each; with ``--jobs 1``, one after another in this process). A finished run is not run again, so an interrupted sweep
continues where it stopped. The final held-out accuracy per G, mean and 95% CI over
seeds, is the analogue of [U-statistic, Table 2 and Figure 5].
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import math
import multiprocessing
import statistics
import time
from pathlib import Path

from grpolab.config.train import ConfigError, TrainConfig
from grpolab.training.runlog import read_metrics

# two-sided 97.5% Student-t quantiles by degrees of freedom, for the CI over few seeds
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


@dataclasses.dataclass
class SweepConfig:
    """Budget-fixed GRPO runs (B = budget / G) over group sizes and seeds on the built-in task.

    Reports the final held-out accuracy per G (mean and 95% CI over seeds), the empirically
    best G, and, with --predict, `grpolab groupsize`'s prediction of G* for the starting policy.
    """

    budget: int = 64
    """Rollouts per step, B * G; every G must divide it."""
    group_sizes: tuple[int, ...] = (2, 4, 8, 16, 32)
    """Group sizes G."""
    seeds: int = 3
    """Seeds per G (0 .. seeds-1)."""
    steps: int = 300
    """GRPO steps per run."""
    out: str = "runs/sweep"
    """Output directory: one run directory per (G, seed), sweep.json, sweep.png."""
    jobs: int = 2
    """Runs at a time, each in its own process with one thread (1: one after another in this process)."""
    model: str = "builtin"
    """Starting policy."""
    estimator: str = "grpo_std"
    """Advantage estimator of every run."""
    lr: float = 5e-5
    """Learning rate of every run."""
    eval_questions: int = 500
    """Held-out questions of the final evaluation."""
    predict: bool = True
    """Also run `grpolab groupsize` on the starting policy and report its G* next to the empirical best."""
    predict_prompts: int = 64
    """Prompts for the prediction."""
    predict_pool: int = 16
    """Rollouts per prompt for the prediction."""
    progress: bool = True
    """Show progress."""

    def validate(self) -> None:
        bad = [G for G in self.group_sizes if G < 2 or self.budget % G]
        if bad:
            raise ConfigError(f"--group-sizes: each G must be >= 2 and divide --budget {self.budget}; bad: {bad}")
        if self.seeds < 1 or self.steps < 1 or self.jobs < 1:
            raise ConfigError("--seeds, --steps and --jobs must be >= 1")

    def run_config(self, G: int, seed: int) -> TrainConfig:
        return TrainConfig(
            out=str(Path(self.out) / f"G{G}-seed{seed}"),
            steps=self.steps,
            seed=seed,
            prompts_per_step=self.budget // G,
            group_size=G,
            estimator=self.estimator,
            lr=self.lr,
            model=self.model,
            eval_questions=self.eval_questions,
            eval_every=0,
            save_every=0,
            keep_checkpoints=1,
            progress=False,
        )


def _final_eval(run_dir: Path, steps: int) -> dict | None:
    if not (run_dir / "metrics.jsonl").is_file():
        return None
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/accuracy_sampled" in r]
    last = [r for r in rows if r["step"] == steps]
    if not last:
        return None
    return {
        "before_sampled": rows[0]["eval/accuracy_sampled"],
        "before_greedy": rows[0]["eval/accuracy_greedy"],
        "sampled": last[0]["eval/accuracy_sampled"],
        "greedy": last[0]["eval/accuracy_greedy"],
    }


def _one_run(cfg: TrainConfig) -> str:
    from transformers.utils import logging as hf_logging

    from grpolab.training.recipe import train

    hf_logging.disable_progress_bar()  # HF's per-load bars would interleave with the sweep's own lines

    t0 = time.perf_counter()
    resume = (Path(cfg.run.out) / "checkpoints").is_dir()
    train(cfg.replace(resume=resume), log=lambda *a, **k: None)
    return f"{cfg.run.out} ({time.perf_counter() - t0:.0f} s)"


def mean_ci_t(values: list[float]) -> tuple[float, float, float]:
    """Mean and Student-t 95% interval over a few seeds."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, math.nan, math.nan
    half = T975.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


def run_sweep(cfg: SweepConfig, log=print) -> dict:
    """Run the (G, seed) grid's missing runs, then report the final accuracy per G (sweep.json, sweep.png)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(G, s) for G in cfg.group_sizes for s in range(cfg.seeds)]
    wall = _run_missing(cfg, out, jobs, log)
    runs = _final_evals(cfg, out, jobs)
    table = _accuracy_table(cfg, runs)
    report = {
        "config": dataclasses.asdict(cfg),
        "wall_s": wall,
        "runs": runs,
        "table": table,
        "best_g_sampled": max(table, key=lambda t: t["sampled"])["G"],
        "best_g_greedy": max(table, key=lambda t: t["greedy"])["G"],
        "before": {
            "sampled": statistics.fmean(r["before_sampled"] for r in runs),
            "greedy": statistics.fmean(r["before_greedy"] for r in runs),
        },
    }
    if cfg.predict:
        report.update(_predicted_g_star(cfg, out))
    (out / "sweep.json").write_text(json.dumps(report, indent=2))
    from grpolab.report.plotting import plot_sweep

    plot_sweep(report, out / "sweep.png")
    return report


def _run_missing(cfg: SweepConfig, out: Path, jobs: list[tuple[int, int]], log) -> float:
    """Run every (G, seed) of ``jobs`` without a final evaluation, ``cfg.jobs`` at a time; their wall time in s."""
    todo = [cfg.run_config(G, s) for G, s in jobs if _final_eval(out / f"G{G}-seed{s}", cfg.steps) is None]
    t0 = time.perf_counter()
    if todo:
        log(f"{len(todo)} of {len(jobs)} runs to do, {cfg.jobs} at a time")
        if cfg.jobs == 1:  # one at a time: in this process, without starting one (and importing torch)
            for i, c in enumerate(todo, 1):
                log(f"[{i}/{len(todo)}] done: {_one_run(c)}")
        else:
            with cf.ProcessPoolExecutor(max_workers=cfg.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                futures = [pool.submit(_one_run, c) for c in todo]
                for i, fut in enumerate(cf.as_completed(futures), 1):
                    log(f"[{i}/{len(todo)}] done: {fut.result()}")
    return time.perf_counter() - t0


def _final_evals(cfg: SweepConfig, out: Path, jobs: list[tuple[int, int]]) -> list[dict]:
    """One record per (G, seed): B and the held-out accuracies before and after training."""
    runs = []
    for G, s in jobs:
        ev = _final_eval(out / f"G{G}-seed{s}", cfg.steps)
        if ev is None:
            raise RuntimeError(f"run G={G} seed={s} has no final evaluation in {out / f'G{G}-seed{s}'}")
        runs.append({"G": G, "seed": s, "B": cfg.budget // G, **ev})
    return runs


def _accuracy_table(cfg: SweepConfig, runs: list[dict]) -> list[dict]:
    """Per G: the final sampled and greedy accuracy, mean and 95% CI over seeds."""
    table = []
    for G in cfg.group_sizes:
        rs = [r for r in runs if r["G"] == G]
        sm, slo, shi = mean_ci_t([r["sampled"] for r in rs])
        gm, glo, ghi = mean_ci_t([r["greedy"] for r in rs])
        table.append(
            {
                "G": G,
                "B": cfg.budget // G,
                "sampled": sm,
                "sampled_ci": [slo, shi],
                "greedy": gm,
                "greedy_ci": [glo, ghi],
            }
        )
    return table


def _predicted_g_star(cfg: SweepConfig, out: Path) -> dict:
    """`grpolab groupsize`'s G* (and its CI) for the starting policy at the sweep's budget."""
    from grpolab.analysis.mse_cmd import GroupsizeConfig, run_groupsize

    gs = run_groupsize(
        GroupsizeConfig(
            policy=cfg.model,
            budget=cfg.budget,
            prompts=cfg.predict_prompts,
            pool=cfg.predict_pool,
            out=str(out / "groupsize"),
            progress=cfg.progress,
        )
    )
    return {"predicted_g_star": gs["g_star"], "predicted_g_star_ci": gs["g_star_ci"]}


def format_sweep(report: dict) -> str:
    cfg = report["config"]
    lines = [
        f"budget B*G = {cfg['budget']}, {cfg['steps']} steps, {cfg['seeds']} seeds; held-out accuracy after "
        f"(before: sampled {report['before']['sampled']:.3f}, greedy {report['before']['greedy']:.3f})",
        f"{'G':>4} {'B':>4} {'sampled, mean [95% CI]':>28} {'greedy, mean [95% CI]':>28}",
    ]
    for t in report["table"]:
        lines.append(
            f"{t['G']:>4} {t['B']:>4} {t['sampled']:>12.3f} [{t['sampled_ci'][0]:.3f}, {t['sampled_ci'][1]:.3f}]"
            f" {t['greedy']:>12.3f} [{t['greedy_ci'][0]:.3f}, {t['greedy_ci'][1]:.3f}]"
        )
    lines.append(f"best G: {report['best_g_sampled']} (sampled), {report['best_g_greedy']} (greedy)")
    if "predicted_g_star" in report:
        lo, hi = report["predicted_g_star_ci"]
        lines.append(
            f"predicted G* (grpolab groupsize on the starting policy): {report['predicted_g_star']:.2f} [{lo:.2f}, {hi:.2f}]"
        )
    lines.append(f"wall time of the runs: {report['wall_s']:.0f} s")
    return "\n".join(lines)
