"""What a run directory says about the task, for the commands that read a run afterwards.

``grpolab eval`` and the probes (``rank``, ``mse``, ``groupsize``) take a model *or* a run (its
directory, or one of its ``checkpoints/step_N``). Given a run they ask the questions, in the
prompt format (chat template, system prompt, few-shot examples), that the run trained on: a
probe of a model trained on one task but measured on another would measure the wrong gradient.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from grpolab.config.train import ConfigError, TrainConfig

# The settings of a run that define its task and prompts (and the reward its gradient used).
TASK_FIELDS = (
    "gguf_file",
    "chat",
    "system_prompt",
    "few_shot",
    "format",
    "eval_data",
    "data",
    "max_operand",
    "mul_max",
    "categories",
    "max_new_tokens",
    "temperature",
    "data_split",
    "eval_split",
    "eval_fraction",
    "prompt_column",
    "reward_fn",
    "reward_weights",
    "eval_reward_fn",
    "code_reward",
    "reward_workers",
    "code_timeout",
    "code_memory_mb",
    "sandbox",
    "sandbox_command",
    "code_allow_network",
    "format_weight",
    "seed",
    "overlong_buffer",
    "overlong_penalty",
    "mask_truncated",
    "top_entropy_quantile",
    "task",
    "env",
    "tools",
    "max_turns",
    "max_episode_tokens",
    "tool_timeout",
    "tool_max_chars",
    "tool_reward",
    "stages",
    "dialogue_context",
)
# The probe options that change the gradient a probe measures; a run's own values are the defaults.
GRADIENT_FIELDS = ("overlong_buffer", "overlong_penalty", "mask_truncated", "top_entropy_quantile")


@dataclasses.dataclass(frozen=True)
class Target:
    weights: str
    """A spec :func:`grpolab.models.policy.load_policy` takes (builtin, a directory, a GGUF file, smollm2-135m-instruct)."""
    adapter: str | None = None
    """A LoRA checkpoint to put on ``weights``."""
    run_config: dict = dataclasses.field(default_factory=dict)
    """The run's config.json ({} for a plain model)."""


def _is_run_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and ((path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file())


def check_intact(target: Target) -> Target:
    """``target`` itself if it is not a training checkpoint or is an intact one (its manifest checks out);
    else :class:`grpolab.models.checkpoint.CheckpointError` in one line naming the damaged file. Hashes the files,
    so it is run on the checkpoints a command uses, not on every checkpoint of a run."""
    from grpolab.models.checkpoint import MANIFEST, CheckpointError, verify

    path = Path(target.adapter or target.weights)
    if (path / MANIFEST).is_file() or (path / "trainer_state.json").is_file():
        problem = verify(path)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    return target


def _checkpoint_target(path: Path, run_cfg: dict) -> Target:
    from grpolab.models.lora import is_adapter_dir

    if is_adapter_dir(path):  # a LoRA run's checkpoint holds the adapter only
        return Target(run_cfg["model"], str(path), run_cfg)
    return Target(str(path), None, run_cfg)


def run_targets(spec: str) -> list[tuple[int, Target]]:
    """A run directory: its starting model (step 0) and every complete checkpoint, oldest first.
    Anything else: one target at step 0."""
    from grpolab.models.checkpoint import checkpoint_dirs

    path = Path(spec)
    if not _is_run_dir(path):
        return [(0, resolve_target(spec))]
    run_cfg = json.loads((path / "config.json").read_text())
    return [(0, Target(run_cfg["model"], None, run_cfg))] + [
        (s, _checkpoint_target(d, run_cfg)) for s, d in checkpoint_dirs(path)
    ]


def resolve_target(spec: str, step: int | None = None) -> Target:
    """The model ``spec`` names: a run directory (its newest checkpoint, or ``step``; 0 = its start),
    a run's ``checkpoints/step_N``, or a plain model spec."""
    path = Path(spec)
    if _is_run_dir(path):
        targets = dict(run_targets(spec))
        if step is None:
            step = max(targets)
            if step == 0:
                raise FileNotFoundError(
                    f"--model {spec}: a run directory with no complete checkpoint (--step 0 is its start)"
                )
        if step not in targets:
            raise FileNotFoundError(
                f"--step {step}: {spec} has checkpoints of steps {sorted(targets)[1:]} (and 0, its start)"
            )
        return check_intact(targets[step])
    if step is not None:
        raise ConfigError(f"--step: only with a run directory as --model, got {spec!r}")
    if path.parent.name == "checkpoints" and (path.parent.parent / "config.json").is_file():
        return check_intact(_checkpoint_target(path, json.loads((path.parent.parent / "config.json").read_text())))
    return Target(spec)


def task_config(target: Target, **given) -> TrainConfig:
    """A training config for ``target``'s task: the run's settings, then ``given`` (flags a user set),
    then the defaults for the model. Resolved (model-dependent defaults filled in)."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    base = {
        k: (tuple(v) if isinstance(v, list) else v)
        for k, v in target.run_config.items()
        if k in TASK_FIELDS and k in known
    }
    cfg = dataclasses.replace(
        TrainConfig(), model=target.weights, **{**base, **{k: v for k, v in given.items() if v is not None}}
    )
    if target.run_config and "gguf_file" not in given and target.weights != target.run_config.get("model"):
        cfg = dataclasses.replace(cfg, gguf_file="")  # a checkpoint directory holds plain safetensors
    return cfg.resolved()


def load_task_policy(target: Target, cfg: TrainConfig, *, device="cpu", dtype=None, sampler=None):
    """The policy of ``target`` with ``cfg``'s prompt format (chat, system prompt, few-shot examples from
    ``sampler``, the training split, as in training)."""
    from grpolab.data.task import few_shot_examples
    from grpolab.models.policy import load_policy, system_prompt_for

    policy = load_policy(target.weights, dtype, gguf_file=cfg.gguf_file, chat=cfg.chat, device=device)
    if target.adapter:
        from grpolab.models.lora import load_lora

        policy.model = load_lora(policy.model, target.adapter, trainable=False)
    policy.system = system_prompt_for(cfg.format, cfg.system_prompt)
    if sampler is not None:
        policy.few_shot = few_shot_examples(sampler, cfg.few_shot)
    return policy


def probe_records(cfg: TrainConfig, n: int, split: str = "held-out", held_out=None, sampler=None) -> list[dict]:
    """The ``n`` prompts a probe measures on ``cfg``'s task: the built-in arithmetic task's fixed probe set (the 500
    of [U-statistic, Sec. 5.1]) or, for a run on data, the first ``n`` of its held-out records (``held_out``) or of
    its training records (``split="train"``: ``sampler.records``)."""
    from grpolab.data.arithmetic import ArithmeticSpec, probe_set

    if cfg.multi_turn:
        raise ConfigError(
            "the gradient probes measure single-turn rollouts; this run played episodes of an environment "
            "(grpolab multiturn measures those)"
        )
    if split not in ("held-out", "train"):
        raise ConfigError(f"--probe-split must be 'held-out' or 'train', got {split!r}")
    if split == "train" and not cfg.data:
        raise ConfigError("--probe-split train: the built-in task draws fresh training questions each step; probe it "
                          "on its fixed probe set (held-out) or give --data")  # fmt: skip
    if not cfg.data and not cfg.eval_data:
        return probe_set(n, ArithmeticSpec(cfg.max_operand, cfg.mul_max, tuple(cfg.categories)))
    source = held_out if split == "held-out" else sampler.records
    return _first_prompts(source, n, f"the {split} prompts of {cfg.eval_data or cfg.data}")


def _first_prompts(records: list[dict], n: int, what: str) -> list[dict]:
    """The first ``n`` of ``records`` (``what`` names them), or a one-line error when there are fewer."""
    if len(records) < n:
        raise ConfigError(f"--prompts {n}: {what} number {len(records)}; ask for at most that")
    return list(records[:n])


def probe_task(target: Target, probe_cfg):
    """What a probe of ``target`` measures on: ``(probe_cfg, cfg, records, sampler)``.

    ``cfg`` is the task of ``target``'s run (or the built-in one) with the probe's own
    ``max_new_tokens``, ``temperature`` and ``format_weight`` (and the gradient options of
    ``GRADIENT_FIELDS`` the probe has), and its ``--reward-fn`` / ``--reward-weights``, on top
    where set; the returned ``probe_cfg`` has those (and the reward functions) filled in from it.
    ``records`` are the first
    ``probe_cfg.prompts`` probe prompts of that task (:func:`probe_records`; with the probe's own
    ``--data``, that file's first records) and ``sampler`` gives its few-shot examples.
    """
    from grpolab.data.dataset import load_records
    from grpolab.data.task import task_data

    keys = ("max_new_tokens", "temperature", "format_weight") + tuple(
        k for k in GRADIENT_FIELDS if hasattr(probe_cfg, k)
    )
    given = {k: getattr(probe_cfg, k) for k in keys}
    if getattr(probe_cfg, "reward_fn", ()):
        given["reward_fn"] = tuple(probe_cfg.reward_fn)
    if getattr(probe_cfg, "reward_weights", ()):
        given["reward_weights"] = tuple(probe_cfg.reward_weights)
    data = getattr(probe_cfg, "data", "")
    if data:  # the probe's own prompts: the file's records as they are, no held-out split
        given.update(data=data, eval_data="", eval_fraction=0.0)
    cfg = task_config(target, **given)
    if data:
        if cfg.few_shot:
            raise ConfigError("--data: this run shows --few-shot examples from its own training data; probe it there")
        records = load_records(cfg.data, cfg.format, cfg.data_split, cfg.prompt_column)
        records, sampler = _first_prompts(records, probe_cfg.prompts, f"the records of {data}"), None
    else:
        held_out, sampler = task_data(cfg, log=lambda *a, **k: None)
        split = getattr(probe_cfg, "probe_split", "held-out")
        records = probe_records(cfg, probe_cfg.prompts, split, held_out, sampler)
    # the probe's report says what it measured with: the run's sampling settings and reward functions
    filled = keys + tuple(k for k in ("reward_fn", "reward_weights") if hasattr(probe_cfg, k))
    probe_cfg = dataclasses.replace(probe_cfg, **{k: getattr(cfg, k) for k in filled})
    return probe_cfg, cfg, records, sampler
