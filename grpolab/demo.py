"""``grpolab demo``: the main job, end to end on a CPU.

1. the SFT warm start of the built-in tiny Llama (shipped in the package; or,
   with ``--retrain-sft``, trained once and cached under the user's cache
   directory, keyed by its config);
2. GRPO on the built-in arithmetic task;
3. held-out accuracy before and after (greedy and sampled at temperature 1),
   and ``plot.png`` in the run directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from grpolab.config import TrainConfig
from grpolab.plotting import plot_run
from grpolab.policy import ASSET_DIR, cache_dir
from grpolab.runlog import read_metrics
from grpolab.sft import SFTConfig, run_sft
from grpolab.trainer import train


@dataclasses.dataclass
class DemoConfig:
    """Warm start + GRPO on the built-in arithmetic task."""

    out: str = "runs/demo"
    """Run directory (config.json, metrics.jsonl, samples.jsonl, checkpoints/, plot.png)."""
    seed: int = 0
    """Seed of the GRPO run."""
    steps: int = 0
    """GRPO steps; 0 = the default of `grpolab train`."""
    retrain_sft: bool = False
    """Train the warm start here (cached after the first time) instead of using the shipped one."""
    resume: bool = False
    """Continue an interrupted demo run from its last checkpoint."""
    progress: bool = True
    """Show progress bars."""


def warm_start(retrain: bool, console: Console) -> str:
    """Path of the SFT warm start: the shipped one, or a cached (or newly trained) one."""
    if not retrain and (ASSET_DIR / "config.json").is_file():
        return "builtin"
    sft_cfg = SFTConfig()
    key = hashlib.sha256(json.dumps({k: v for k, v in dataclasses.asdict(sft_cfg).items() if k not in ("out", "progress")}, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir() / f"sft-{key}"
    if (path / "config.json").is_file():
        console.print(f"warm start: cached at {path}")
        return str(path)
    console.print(f"warm start: training the SFT model ({sft_cfg.steps} steps), cached at {path}")
    run_sft(dataclasses.replace(sft_cfg, out=str(path)))
    return str(path)


def run_demo(cfg: DemoConfig) -> dict:
    console = Console()
    model = warm_start(cfg.retrain_sft, console)
    train_cfg = dataclasses.replace(TrainConfig(), out=cfg.out, seed=cfg.seed, model=model, resume=cfg.resume, progress=cfg.progress)
    if cfg.steps:
        train_cfg = dataclasses.replace(train_cfg, steps=cfg.steps)
    out = train(train_cfg, log=console.print)
    rows = read_metrics(Path(out) / "metrics.jsonl")
    evals = [r for r in rows if "eval/accuracy_greedy" in r]
    before, after = evals[0], evals[-1]
    table = Table(title=f"held-out accuracy ({train_cfg.eval_questions} questions; sampled: {train_cfg.eval_samples} samples each at T=1)")
    table.add_column("")
    table.add_column("greedy", justify="right")
    table.add_column("sampled", justify="right")
    for name, r in ((f"before (step {before['step']})", before), (f"after (step {after['step']})", after)):
        table.add_row(name, f"{r['eval/accuracy_greedy']:.3f}", f"{r['eval/accuracy_sampled']:.3f}")
    console.print(table)
    png = plot_run(out, title=f"grpolab demo: GRPO on the built-in arithmetic task (seed {cfg.seed})")
    console.print(f"run directory: {out}   plot: {png}")
    summary = {"before": before, "after": after}
    (Path(out) / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
