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

from grpolab.common.errors import ConfigError
from grpolab.common.given import NOTHING, Given
from grpolab.config import fields
from grpolab.config.objective import ObjectiveSection
from grpolab.config.rollout import GenerationSection, RewardSection, SandboxSection
from grpolab.config.run import EvalSection, run_config_file
from grpolab.config.task import (
    ArithmeticSection,
    DataSection,
    EpisodesSection,
    PolicySection,
    PromptSection,
    validate_task,
)
from grpolab.config.train import model_defaults
from grpolab.data.task import task_data
from grpolab.env import resolved_data


@dataclasses.dataclass(frozen=True)
class Target:
    weights: str
    """A spec :func:`grpolab.models.policy.load_policy` takes (builtin, a directory, a GGUF file, smollm2-135m-instruct)."""
    adapter: str | None = None
    """A LoRA checkpoint to put on ``weights``."""
    run_config: dict = dataclasses.field(default_factory=dict)
    """The run's config.json ({} for a plain model)."""


def _is_run_dir(path: Path) -> bool:
    return run_config_file(path).is_file() and ((path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file())


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
    run_cfg = json.loads(run_config_file(path).read_text())
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
    if path.parent.name == "checkpoints" and run_config_file(path.parent.parent).is_file():
        return check_intact(_checkpoint_target(path, json.loads(run_config_file(path.parent.parent).read_text())))
    return Target(spec)


def run_config(spec: str) -> dict:
    """The config.json of the run ``spec`` names (its directory, or one of its ``checkpoints/step_N``); {} for a
    plain model. A command reading a run takes its options from here as their defaults."""
    path = Path(spec)
    for run in (path, path.parent.parent if path.parent.name == "checkpoints" else None):
        if run is not None and _is_run_dir(run):
            return json.loads(run_config_file(run).read_text())
    return {}


@fields.sectioned
class RunTask:
    """A run's task, as the commands that read the run afterwards ask it: the policy's prompt format, the records,
    the episodes, how completions were sampled and scored, and the loss's token selection. A plain model's is
    training's defaults for it."""

    policy: PolicySection = PolicySection()
    prompt: PromptSection = PromptSection()
    dataset: DataSection = DataSection()
    arithmetic: ArithmeticSection = ArithmeticSection()
    episodes: EpisodesSection = EpisodesSection()
    generation: GenerationSection = GenerationSection()
    reward: RewardSection = RewardSection()
    code_sandbox: SandboxSection = SandboxSection()
    objective: ObjectiveSection = ObjectiveSection()
    eval: EvalSection = EvalSection()
    seed: int = 0

    @classmethod
    def of(cls, target: Target, command=None, given: Given = NOTHING, **options) -> RunTask:
        """The task of ``target``'s run, with the options a command's config ``command`` takes from a run
        (:func:`grpolab.config.fields.from_run`) as that config has them, then ``options`` (flat names: a command's
        own records, say), the model's defaults filled in and ``--format auto`` resolved from the data (``given``:
        rows given to the Python API)."""
        task = fields.from_flat(cls, target.run_config)
        task = fields.replace(task, model=target.run_config.get("model", target.weights))
        if command is not None:
            values = {n: fields.get(command, n) for n in fields.from_run(type(command))}
            task = fields.replace(task, **{n: v for n, v in values.items() if n in fields.options(cls)})
        task = fields.replace(task, **options)
        defaults = model_defaults(task.policy.model)
        unset = {n: defaults[n] for n in defaults if n in fields.options(cls) and fields.get(task, n) is None}
        task = fields.replace(task, **unset)
        return dataclasses.replace(task, dataset=resolved_data(task.dataset, task.episodes, given))

    def fill(self, command):
        """``command`` (a config) with its from-run options set to this task's values: what a report records it
        was measured with."""
        names = [n for n in fields.from_run(type(command)) if n in fields.options(type(self))]
        return fields.replace(command, **{n: fields.get(self, n) for n in names})

    @property
    def multi_turn(self) -> bool:
        return self.episodes.multi_turn

    def validate(self) -> None:
        """Each section's checks, and those between the task's sections."""
        for name in fields.sections(type(self)):
            getattr(self, name).validate()
        validate_task(self.prompt, self.dataset, self.episodes)

    def data(self, eval_questions: int | None = None, log=print, given: Given = NOTHING):
        """``(held_out, sampler)`` of the task (:func:`grpolab.data.task.task_data`); at most ``eval_questions``
        held out (default: the run's)."""
        questions = self.eval.eval_questions if eval_questions is None else eval_questions
        return task_data(self.dataset, self.arithmetic, self.episodes, questions, self.seed, log, given)


def load_task_policy(target: Target, task: RunTask, *, device="cpu", dtype=None, sampler=None, given=NOTHING):
    """The policy of ``target`` with ``task``'s prompt format (chat, system prompt, few-shot examples from
    ``sampler``, the training split, as in training). The run's ``--gguf-file`` applies to its own starting model,
    not to a checkpoint (a checkpoint directory holds plain safetensors)."""
    from grpolab.data.task import few_shot_examples
    from grpolab.models.policy import load_policy, system_prompt_for

    own = target.weights == task.policy.model  # the run's starting model, not a checkpoint
    gguf, revision = (task.policy.gguf_file, task.policy.revision) if own else ("", "")
    policy = load_policy(
        target.weights, dtype, gguf_file=gguf, revision=revision, chat=task.prompt.chat, device=device, given=given
    )
    if target.adapter:
        from grpolab.models.lora import load_lora

        policy.model = load_lora(policy.model, target.adapter, trainable=False)
    policy.system = system_prompt_for(task.dataset.format, task.prompt.system_prompt)
    if sampler is not None:
        policy.few_shot = few_shot_examples(sampler, task.prompt.few_shot)
    return policy


def probe_records(task: RunTask, n: int, split: str = "held-out", held_out=None, sampler=None) -> list[dict]:
    """The ``n`` prompts a probe measures on ``task``: the built-in arithmetic task's fixed probe set (the 500 of
    [U-statistic, Sec. 5.1]) or, for a run on data, the first ``n`` of its held-out records (``held_out``) or of its
    training records (``split="train"``: ``sampler.records``)."""
    from grpolab.data.arithmetic import ArithmeticSpec, probe_set

    if task.multi_turn:
        raise ConfigError(
            "the gradient probes measure single-turn rollouts; this run played episodes of an environment "
            "(grpolab multiturn measures those)"
        )
    if split not in ("held-out", "train"):
        raise ConfigError(f"--probe-split must be 'held-out' or 'train', got {split!r}")
    data = task.dataset
    if split == "train" and not data.data:
        raise ConfigError("--probe-split train: the built-in task draws fresh training questions each step; probe it "
                          "on its fixed probe set (held-out) or give --data")  # fmt: skip
    if not data.data and not data.eval_data:
        arith = task.arithmetic
        return probe_set(n, ArithmeticSpec(arith.max_operand, arith.mul_max, tuple(arith.categories)))
    source = held_out if split == "held-out" else sampler.records
    return _first_prompts(source, n, f"the {split} prompts of {data.eval_data or data.data}")


def _first_prompts(records: list[dict], n: int, what: str) -> list[dict]:
    """The first ``n`` of ``records`` (``what`` names them), or a one-line error when there are fewer."""
    if len(records) < n:
        raise ConfigError(f"--prompts {n}: {what} number {len(records)}; ask for at most that")
    return list(records[:n])


def probe_task(target: Target, probe_cfg, given: Given = NOTHING) -> tuple[RunTask, list[dict], object]:
    """What a probe of ``target`` measures on: ``(task, records, sampler)``.

    ``task`` is the task of ``target``'s run (or the built-in one) with the probe's own sampling, reward and token
    options on top (its from-run options); ``records`` are the first ``probe_cfg.prompts`` probe prompts of that
    task (:func:`probe_records`; with the probe's own ``--data``, that file's first records) and ``sampler`` gives
    its few-shot examples.
    """
    from grpolab.data.dataset import load_records

    if probe_cfg.data:  # the probe's own prompts: the file's records as they are, no held-out split
        task = RunTask.of(target, probe_cfg, given, data=probe_cfg.data, eval_data="", eval_fraction=0.0)
        if task.prompt.few_shot:
            raise ConfigError("--data: this run shows --few-shot examples from its own training data; probe it there")
        d = task.dataset
        records = load_records(d.data, d.format, d.data_split, d.prompt_column, given, d.source())
        return task, _first_prompts(records, probe_cfg.prompts, f"the records of {probe_cfg.data}"), None
    task = RunTask.of(target, probe_cfg, given)
    held_out, sampler = task.data(log=lambda *a, **k: None, given=given)
    records = probe_records(task, probe_cfg.prompts, probe_cfg.probe_split, held_out, sampler)
    return task, records, sampler


def run_defaults(cls, spec: str):
    """For a command reading the run ``spec`` names: a ``cls`` config whose from-run options
    (:func:`grpolab.config.fields.from_run`) are the run's own; None when ``spec`` names no run."""
    config = run_config(spec)
    return fields.with_run(cls, config) if config else None


def run_defaults_for(cls, model_field: str):
    """For a command whose ``model_field`` option names a model or a run: the function that gives, for a config as
    parsed, the config whose values replace ``cls``'s defaults (:func:`run_defaults`; None for a plain model). The
    command line and the Python API parse the flags, or keywords, again over it."""

    def base_of(cfg):
        spec = fields.get(cfg, model_field)
        return run_defaults(cls, spec[0] if isinstance(spec, tuple) and spec else spec)

    return base_of
