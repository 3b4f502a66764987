"""grpolab from Python: objects in, a run out, in the shape of TRL's ``GRPOTrainer``.

::

    import grpolab

    run = grpolab.train(model="builtin", steps=20, out="runs/x")
    run.dir, run.metrics[-1]["reward/mean"], run.evaluations[-1]["eval/accuracy_greedy"]
    run.policy.model  # the trained model (and run.policy.tokenizer)

Every function takes its command's options as keywords (``group_size=8`` is ``--group-size 8``), checked as the flags
are, and in place of what a flag names it also takes the object itself: a loaded transformers model (with
``tokenizer=``), a ``datasets.Dataset`` or a list of dicts, reward functions (TRL's form or grpolab's), an environment
class, tool functions. The object itself is what is used, not a copy: a model passed in is the one that trains.
``grpolab train``, ``grpolab eval`` and the probe commands parse their flags and call these same functions.

What a run directory records of an object: its importable name when it has one (``module:function``: the CLI and a
resumed run load it again), else a description ("reward function defined in a notebook: correct", "data in memory:
200 rows, sha256 ...", "model object: LlamaForCausalLM (...)"); resuming such a run, or probing it, needs the same
objects passed again, and says so in one line when one is missing (:mod:`grpolab.commands.objects`).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from grpolab.commands.objects import ObjectNames
from grpolab.common.given import Given
from grpolab.config import fields as fields_of
from grpolab.config import options
from grpolab.config.run import run_config_file
from grpolab.config.train import ConfigError, TrainConfig
from grpolab.eval.runs import run_defaults_for
from grpolab.models.policy import Policy

__all__ = ["Run", "train", "evaluate", "diagnose", "rank", "mse", "groupsize", "multiturn_bias"]


@dataclasses.dataclass
class Run:
    """A training run that :func:`train` finished (or that a signal stopped after a saved step).

    Example::

        run = grpolab.train(steps=20, out="runs/x")
        print(run.dir, len(run.metrics), run.evaluations[-1]["eval/accuracy_greedy"])
        answer = run.policy.tokenizer.decode(run.policy.model.generate(...)[0])
    """

    dir: Path
    """The run directory: config.json, metrics.jsonl, samples.jsonl, checkpoints/, as ``grpolab train`` writes it."""
    policy: Policy
    """The trained model (``.model``, the very object passed as ``model=`` if one was) and its ``.tokenizer``."""

    @property
    def config(self) -> dict:
        """The run's config.json: every option, objects named or described."""
        return json.loads(run_config_file(self.dir).read_text())

    @property
    def metrics(self) -> list[dict]:
        """Every step's metrics (``step``, ``reward/mean``, ``loss/...``), as in metrics.jsonl."""
        from grpolab.training.runlog import read_metrics

        return read_metrics(self.dir / "metrics.jsonl")

    @property
    def findings(self) -> list[dict]:
        """What ``grpolab doctor`` finds in the run (:func:`diagnose`): empty for a run with no problem."""
        return diagnose(self.dir)

    @property
    def evaluations(self) -> list[dict]:
        """The held-out evaluations (step 0, every ``eval_every`` steps, the last): ``step`` and the ``eval/*``
        metrics (``eval/accuracy_greedy``, ``eval/accuracy_sampled`` and their intervals)."""
        return [
            {"step": m["step"], **{k: v for k, v in m.items() if k.startswith("eval/")}}
            for m in self.metrics
            if any(k.startswith("eval/") for k in m)
        ]


def _fields(cls, model_field: str, model, tokenizer, keywords: dict, names: ObjectNames) -> dict:
    """The options of ``keywords`` (TRL's keywords renamed, objects replaced by the strings the flags take, kept in
    ``names``); which options may name an object, and their keywords, come from ``cls``'s own fields."""
    takes = fields_of.object_options(cls)
    aliases: dict[str, str] = {}
    for name, (_, kw) in takes.items():  # reward_funcs: --reward-fn's (its models are set apart first)
        aliases.setdefault(kw, name)
    keywords = reward_models_apart(cls, keywords)
    out: dict = {}
    for key, value in keywords.items():
        name = aliases.get(key, key)
        if value is None:  # not given: the option's default
            continue
        if name in out:
            raise ConfigError(f"{key}: sets {options.flag(name)}, which another keyword sets too; give one")
        out[name] = value
    if model is not None:
        spec = names.model_spec(model, tokenizer)
        several = typing.get_origin(options.field_types(cls)[model_field]) is tuple  # mse: --policy A --policy B
        out[model_field] = (spec,) if several else spec
    elif tokenizer is not None:
        raise ConfigError("tokenizer: only with model=<a loaded model> (a path brings its own tokenizer)")
    for name, (kind, kw) in takes.items():
        if name in out and name != model_field:
            out[name] = _object_spec(names, out[name], kind, kw, name, cls)
    return out


def reward_models_apart(cls, keywords: dict) -> dict:
    """``keywords`` with TRL's ``reward_funcs`` split: its reward models (a directory or Hub id, a loaded model:
    :func:`grpolab.rewards.model.names_a_model`) to ``reward_model``, each with its ``reward_processing_classes``
    entry (TRL's: the tokenizer it scores with, a loaded model's or one named by a path or id; None, or left out:
    loaded from the model's path), the rest to the functions. The components' order is the functions', then the
    models' (as the flags' is): ``reward_weights``, given in the list's order, follow their entries."""
    from grpolab.rewards.model import names_a_model

    funcs, tokenizers = keywords.get("reward_funcs"), keywords.get("reward_processing_classes")
    entries = [] if funcs is None else list(funcs) if isinstance(funcs, list | tuple) else [funcs]
    is_model = [names_a_model(e) for e in entries]
    if tokenizers is not None:
        tokenizers = list(tokenizers) if isinstance(tokenizers, list | tuple) else [tokenizers]
        if len(tokenizers) != len(entries):
            raise ConfigError(
                f"reward_processing_classes: {len(tokenizers)} for {len(entries)} reward_funcs (None for a function)"
            )
        if any(t is not None and not m for m, t in zip(is_model, tokenizers)):
            raise ConfigError("reward_processing_classes: a tokenizer only for a reward model (None for a function)")
    if not any(is_model):
        return {k: v for k, v in keywords.items() if k != "reward_processing_classes"}
    if "reward_model" not in fields_of.options(cls):
        raise ConfigError(f"reward_funcs: {entries[is_model.index(True)]!r} is a reward model; functions only here")
    if keywords.get("reward_model") is not None:
        raise ConfigError("reward_model: give reward models either there or in reward_funcs, not both")
    tokenizers = tokenizers or [None] * len(entries)
    models = [e if isinstance(e, str) and t is None else (e, t) for e, m, t in zip(entries, is_model, tokenizers) if m]
    out = {k: v for k, v in keywords.items() if k != "reward_processing_classes"}
    out["reward_funcs"] = [e for e, m in zip(entries, is_model) if not m] or None
    out["reward_model"] = models
    weights = keywords.get("reward_weights")
    if weights is not None and len(weights) == len(entries):  # else the count is the weights' own error
        out["reward_weights"] = [w for w, m in zip(weights, is_model) if not m] + [
            w for w, m in zip(weights, is_model) if m
        ]
    return out


def _object_spec(names: ObjectNames, value, kind: str, keyword: str, name: str, cls):
    """The string (or strings, for a repeatable option) option ``name`` records for ``value``."""
    if kind == "data":
        return names.data_spec(value, keyword)
    if kind == "reward model":
        return tuple(names.reward_model_spec(v) for v in (value if isinstance(value, list | tuple) else [value]))
    if kind == "model":  # another model than the policy (--teacher): a path, a Policy, or (model, tokenizer)
        model, tokenizer = value if isinstance(value, tuple) else (value, None)
        return names.model_spec(model, tokenizer)
    flag = options.flag(name)
    if isinstance(fields_of.options(cls)[name].field.default, tuple):  # a repeatable flag: one or several
        return tuple(
            names.callable_spec(f, kind, flag) for f in (value if isinstance(value, list | tuple) else [value])
        )
    return names.callable_spec(value, kind, flag)


def _config(cls, command: str, model_field: str, model, tokenizer, config, keywords: dict, base_of=None):
    """``(config, given)``: ``config`` (a parsed command line) as it is, or the config of the keywords (names and
    types checked), and the objects they gave (:class:`grpolab.common.given.Given`). ``base_of``: as the command
    line's (``train(resume=True)``: the run's own options are the defaults)."""
    if config is not None:
        if model is not None or tokenizer is not None or any(v is not None for v in keywords.values()):
            raise ConfigError("config: give the options either as a config object or as keywords, not both")
        return config, Given()
    names = ObjectNames(cls)
    values = _fields(cls, model_field, model, tokenizer, keywords, names)
    cfg = options.config_from(cls, values, command)
    base = base_of(cfg) if base_of is not None else None
    if base is not None:
        cfg = options.config_from(cls, values, command, base=base)
    return cfg, names.given()


def train(
    model: str | Any | None = None,
    train_dataset: str | Any | None = None,
    reward_funcs: Callable | str | Sequence[Callable | str] | None = None,
    *,
    eval_dataset: str | Any | None = None,
    env: type | dict[str, type] | str | None = None,
    tools: Sequence[Callable | str] | None = None,
    tokenizer: Any | None = None,
    config: TrainConfig | None = None,
    log: Callable[[str], None] = print,
    hooks=None,  # a grpolab.training.recipe.RunHooks told of each step (grpolab.trl's callbacks)
    **fields,
) -> Run:
    """GRPO training, as ``grpolab train``; returns the :class:`Run`.

    Example::

        from datasets import Dataset

        def last_letter(completions, answer, **kwargs):  # TRL's form: columns arrive by name
            return [float(c.strip()[-1:] == a) for c, a in zip(completions, answer)]

        ds = Dataset.from_list([{"prompt": "Last letter of 'cat'?", "answer": "t"}, ...])
        run = grpolab.train(model="smollm2-135m-instruct", train_dataset=ds, reward_funcs=[last_letter],
                            steps=20, out="runs/letters")

    Several processes: ``torchrun --nproc-per-node P script.py``; each process calls ``train`` and trains its share.

    Args:
        model (str | Any | None): a path, name or Hub id (``"org/name"``, ``revision=``) as ``--model`` takes (default
            ``builtin``), a loaded transformers causal LM (``tokenizer=``; trains in place, its dtype kept under
            ``precision="auto"``), or a finished run's ``run.policy``.
        train_dataset (str | Any | None): a ``datasets.Dataset`` (a DatasetDict of one split), a list of dicts, or a
            path or Hub id as ``--data`` takes (``data_config=``). Rows are read as a file's: a ``prompt`` column of
            text or chat messages (``prompt_column=``), every other column passed to the reward functions.
        reward_funcs (Callable | str | Sequence[Callable | str] | None): one or several functions, TRL's
            ``fn(prompts, completions, **columns)`` or grpolab's ``fn(completions, records)``, or ``"module:function"``
            strings; reward models too (a directory, Hub id or loaded model: ``reward_processing_classes=``); weights
            with ``reward_weights=``. None: the built-in answer check (in episodes: the environment's return).
        eval_dataset (str | Any | None): held-out rows, in the forms ``train_dataset`` takes (default:
            ``eval_fraction=0.1`` of it).
        env (type | dict[str, type] | str | None): an environment class (TRL's ``reset(**row)`` shape or grpolab's
            ``reset``/``step``), a dict of TRL-shape classes routed by an ``environment`` column, or its
            ``"module:Class"`` name: episodes (docs/environments.md).
        tools (Sequence[Callable | str] | None): tool functions (or their ``"module:function"`` names) the policy
            calls in episodes (docs/environments.md).
        tokenizer (Any | None): the tokenizer (or processor) of a loaded ``model``; None with a path, which brings
            its own.
        config (TrainConfig | None): a whole :class:`grpolab.config.train.TrainConfig` instead of keywords.
        log (Callable[[str], None]): where the run's progress lines go (default ``print``).
        hooks (RunHooks | None): a :class:`grpolab.training.recipe.RunHooks` told of each step (``grpolab.trl``'s
            callbacks); None: none.
        **fields: any ``grpolab train`` option by its field name (``steps=100, group_size=8, lr=1e-5, out="runs/x"``).

    Returns:
        Run: the finished run: its directory (``run.dir``: config.json, metrics.jsonl, checkpoints/) and its trained
            policy (``run.policy``: the very model object passed as ``model``, if one was).

    Raises:
        ConfigError: a wrong option name or type (one line, the flag's); options given both as ``config`` and as
            keywords; ``tokenizer`` without a loaded model, or a loaded model without it; ``nproc`` > 1 from Python
            (launch the script with torchrun instead).
    """
    from grpolab.training import launch
    from grpolab.training.recipe import run_training, saved_config

    keywords = dict(train_dataset=train_dataset, reward_funcs=reward_funcs, eval_dataset=eval_dataset, env=env,
                    tools=tools, **fields)  # fmt: skip
    resumed = lambda c: saved_config(c.run.out) if c.run.resume else None  # noqa: E731
    cfg, given = _config(TrainConfig, "train", "model", model, tokenizer, config, keywords, base_of=resumed)
    nproc = cfg.run.nproc
    if launch.relaunches(nproc):
        raise ConfigError(
            f"--nproc: {nproc} processes from Python: launch the script with torchrun --nproc-per-node "
            f"{nproc} (each process calls grpolab.train), or use grpolab train --nproc {nproc}"
        )
    recipe = run_training(cfg, log, given, hooks)
    return Run(Path(recipe.out), recipe.trainer.policy)


def evaluate(
    model: str | Any | None = None,
    eval_dataset: str | Any | None = None,
    reward_funcs: Callable | str | Sequence[Callable | str] | None = None,
    *,
    train_dataset: str | Any | None = None,
    tokenizer: Any | None = None,
    config=None,
    log: Callable[[str], None] = print,
    **fields,
) -> dict:
    """Held-out greedy and sampled accuracy, as ``grpolab eval``; returns its report: ``report["metrics"]`` holds
    ``eval/accuracy_greedy`` and ``eval/accuracy_sampled`` with their 95% intervals (``_lo``, ``_hi``) and per
    category, ``report["examples"]`` the questions with their completions.

    ``model``: as :func:`train` takes it, or a run directory (``run.dir``: its newest checkpoint, its task's
    settings). ``eval_dataset``: the questions (default: the built-in test set, or the run's); ``reward_funcs``: the
    first one's mean is the accuracy (default: the built-in answer check). ``**fields``: ``grpolab eval``'s options
    (``questions=100, samples=4, json="eval.json"``).

    Example::

        before = grpolab.evaluate(model=model, tokenizer=tok, eval_dataset=held_out, reward_funcs=[last_letter])
        after = grpolab.evaluate(model=run.policy, eval_dataset=held_out, reward_funcs=[last_letter])
        print(before["metrics"]["eval/accuracy_greedy"], after["metrics"]["eval/accuracy_greedy"])
    """
    from grpolab.commands.eval import EvalConfig, run_eval

    keywords = dict(eval_dataset=eval_dataset, reward_funcs=reward_funcs, train_dataset=train_dataset, **fields)
    base_of = run_defaults_for(EvalConfig, "model")
    cfg, given = _config(EvalConfig, "eval", "model", model, tokenizer, config, keywords, base_of)
    return run_eval(cfg, log, given)


def evaluate_groups(
    model: str | Any | None,
    eval_dataset: Any,
    reward_funcs: Callable | str | Sequence[Callable | str] | None = None,
    *,
    parts: Sequence[int],
    completions: int,
    batch_prompts: int,
    env: type | dict[str, type] | str | None = None,
    tools: Sequence[Callable | str] | None = None,
    tokenizer: Any | None = None,
    log: Callable[[str], None] = print,
    **fields,
) -> list:
    """TRL's evaluation (:mod:`grpolab.eval.groups`) of ``model`` as it is: ``completions`` completions of each row
    of ``eval_dataset``, scored by the run's whole reward (its ``reward_funcs``, reward models and weights), in
    batches of ``batch_prompts`` rows, with a training step's metrics; the rows taken in consecutive parts of
    ``parts`` rows, each evaluated on its own. ``**fields``: ``train``'s options (the objective, the sampling), as
    :func:`train` takes them; the run's parts are built as :func:`train` builds them, without a run directory.

    Returns:
        list[GroupEvaluation]: one per part, in order (``grpolab.eval.groups.GroupEvaluation``).

    Raises:
        ConfigError: as :func:`train`; ``eval_questions`` below the rows given.
    """
    from grpolab.algo.groups import offsets
    from grpolab.training.evaluation import evaluate_groups as evaluate_parts
    from grpolab.training.setup import resolve_config
    from grpolab.training.trainer import GRPOTrainer

    keywords = dict(eval_dataset=eval_dataset, reward_funcs=reward_funcs, env=env, tools=tools, **fields)
    cfg, given = _config(TrainConfig, "train", "model", model, tokenizer, None, keywords)
    trainer = GRPOTrainer(resolve_config(cfg, given=given), log=log, given=given)
    try:
        bounds, held_out = offsets(parts), trainer.task_stage.held_out
        if len(held_out) != bounds[-1]:
            raise ConfigError(f"eval_questions: {len(held_out)} of the {bounds[-1]} rows given are held out")
        records = [held_out[a:b] for a, b in zip(bounds, bounds[1:])]
        return evaluate_parts(trainer, records, completions, batch_prompts)
    finally:
        trainer.close()


def diagnose(run: str | Path | Run, every: int | None = None) -> list[dict]:
    """The conditions that keep a run from learning, as ``grpolab doctor RUN --json`` gives them, most serious
    first: each a dict with ``name``, ``severity`` ('error', 'warning', 'info'), ``title``, ``evidence``, ``fix``,
    the ``keys`` that show it, ``first_step``, ``ongoing``, an ``example`` from the run's samples and what it
    ``explains``. ``every``: the steps between two checks (default: the run's --doctor-every).

    Example::

        for f in grpolab.diagnose("runs/x"):
            print(f["severity"], f["title"], "->", f["fix"])
    """
    from grpolab.doctor.examine import as_json, check_every, examine

    data, findings = examine(run.dir if isinstance(run, Run) else run, every)
    return as_json(data, findings, check_every(data, every))["findings"]


def _probe(command: str, cls, run, model_field: str, model, tokenizer, config, log, keywords: dict):
    """A probe command's ``run`` on its config ``cls`` built from the keywords."""
    base_of = run_defaults_for(cls, model_field)
    cfg, given = _config(cls, command, model_field, model, tokenizer, config, keywords, base_of)
    if hasattr(cfg, "validate"):  # the command's own checks, before anything loads
        cfg.validate()
    return run(cfg, log, given)


def rank(model=None, data=None, reward_funcs=None, *, tokenizer=None, config=None, log=print, **fields) -> dict:
    """The spectrum of the per-rollout gradient matrix, as ``grpolab rank``; returns its report (rank.json's).

    ``model``: a run directory (every checkpoint), a path or name, or a loaded model (with ``tokenizer=``);
    ``data``: the probe prompts (a Dataset, a list of dicts or a path); ``reward_funcs``: as :func:`train` takes.

    Example::

        report = grpolab.rank(model=run.dir, group_sizes=[4, 8], prompts=8, out="runs/x-rank")
    """
    from grpolab.analysis.rank import RankConfig, run_rank

    keywords = dict(data=data, reward_funcs=reward_funcs, **fields)
    return _probe("rank", RankConfig, run_rank, "checkpoint", model, tokenizer, config, log, keywords)


def mse(model=None, data=None, reward_funcs=None, *, tokenizer=None, config=None, log=print, **fields) -> dict:
    """The MSE of the vanilla, grpo, rloo and oracle gradient estimators against G, as ``grpolab mse``.

    Example::

        report = grpolab.mse(model=model, tokenizer=tok, data=ds, reward_funcs=[last_letter], prompts=8, pool=8)
    """
    from grpolab.analysis.mse_cmd import MseConfig, run_mse

    keywords = dict(data=data, reward_funcs=reward_funcs, **fields)
    return _probe("mse", MseConfig, run_mse, "policy", model, tokenizer, config, log, keywords)


def groupsize(model=None, data=None, reward_funcs=None, *, tokenizer=None, config=None, log=print, **fields) -> dict:
    """The three MSE constants and the best group size under a fixed budget B*G, as ``grpolab groupsize``.

    Example::

        report = grpolab.groupsize(model=run.dir, prompts=8, pool=8, budget=32)
    """
    from grpolab.analysis.mse_cmd import GroupsizeConfig, run_groupsize

    keywords = dict(data=data, reward_funcs=reward_funcs, **fields)
    return _probe("groupsize", GroupsizeConfig, run_groupsize, "policy", model, tokenizer, config, log, keywords)


def multiturn_bias(
    model=None, data=None, reward_funcs=None, *, env=None, tools=None, tokenizer=None, config=None, log=print, **fields
) -> list[dict]:
    """Per-stage bias of GRPO's advantage in multi-turn tasks, as ``grpolab multiturn``: exactly on a chain
    (``env="chain"``), or on a policy's own episodes in an environment (a class, ``"arith"``, or ``tools=``).

    Example::

        rows = grpolab.multiturn_bias(model=model, tokenizer=tok, env=MyEnv, data=records, episodes=8, branches=4)
    """
    from grpolab.analysis.multiturn import MultiturnConfig, run_multiturn

    keywords = dict(data=data, reward_funcs=reward_funcs, env=env, tools=tools, **fields)
    return _probe("multiturn", MultiturnConfig, run_multiturn, "policy", model, tokenizer, config, log, keywords)
