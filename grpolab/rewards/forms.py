"""The two forms a reward function comes in, told apart and made one.

A reward function is any callable ``(completions: list[str], records: list[dict]) -> list[float]``; ``records``
carry the ground truth. Functions written for TRL, ``(prompts, completions, **kwargs)`` with the record's fields as
keyword arguments, are adapted to that form by :func:`from_trl` (:func:`reward_form` tells the two apart from the
signature).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal

from grpolab.common.given import NOTHING, Given
from grpolab.rewards.builtin import RewardFn, accuracy_reward

ACCEPTED_FORMS = (
    "grpolab's fn(completions, records) -> list[float] or TRL's fn(prompts, completions, **kwargs) -> list[float]"
)


def reward_form(fn: Callable) -> Literal["grpolab", "trl"]:
    """Which calling convention ``fn`` follows, read from its signature.

    - ``"grpolab"``: called as ``fn(completions, records)`` (two positional parameters;
      a second one named ``records`` settles it).
    - ``"trl"``: called with keywords, as TRL's GRPOTrainer does:
      ``fn(prompts=..., completions=..., **record_fields)``; recognised by a parameter
      named ``completions`` together with ``prompts`` or ``**kwargs``.

    Raises ValueError naming the accepted forms when neither fits.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: assume our own form
        return "grpolab"
    kinds = inspect.Parameter
    positional = [p for p in params.values() if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    var_kw = any(p.kind == kinds.VAR_KEYWORD for p in params.values())
    var_pos = any(p.kind == kinds.VAR_POSITIONAL for p in params.values())
    if len(positional) >= 2 and positional[1].name == "records":
        return "grpolab"
    by_keyword = {p.name for p in params.values() if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    if "completions" in by_keyword and ("prompts" in by_keyword or var_kw):
        return "trl"
    if var_kw and by_keyword and by_keyword <= set(TRL_ARGUMENTS):  # fn(environments, **kwargs): TRL's keywords only
        return "trl"
    required = [p for p in positional if p.default is p.empty]
    if (len(positional) >= 2 or var_pos) and len(required) <= 2:
        return "grpolab"
    raise ValueError(f"its signature {inspect.signature(fn)} fits neither accepted form: {ACCEPTED_FORMS}")


def from_trl(fn: Callable, prompt_of: Callable[[dict], Any], chat: bool) -> RewardFn:
    """A TRL-convention reward function as a grpolab one.

    It is called as TRL calls it: ``fn(prompts=..., completions=..., **fields)`` where
    every field of the records (``ground_truth``, ``answer``, your dataset's columns) is
    a keyword argument holding one value per completion. A prompt the model saw as chat messages is that message
    list, its completion ``[{"role": "assistant", "content": text}]`` (TRL's conversational format); a text prompt
    and its completion are plain strings (each row by its own form, as TRL's ``is_conversational``). An ``async def`` function stays one: its
    awaitable is awaited by :func:`grpolab.rewards.rewarder.score`, beside the step's other async functions. For
    episodes of an environment, a function that takes ``environments`` (or ``**kwargs``) gets each completion's
    environment object (a TRL-shape class's own instance), in the order of the completions, as TRL passes them. As
    TRL does, a function that takes them (by name or ``**kwargs``) also gets ``completion_ids`` (each completion's
    token ids, its EOS included; single-turn rollouts), and ``log_extra(column, values)`` and ``log_metric(name,
    value)`` (:class:`RewardLog`). A ``None`` in the result means "does not apply", as in TRL: it is kept as None
    (:func:`grpolab.rewards.rewarder.score` counts it 0 in the total and leaves it out of the function's mean).
    """
    reserved = {"prompts", "completions", "prompt", *TRL_ARGUMENTS}  # the prompt column arrives as ``prompts``
    takes_environments = _accepts(fn, "environments")
    takes_ids = _accepts(fn, "completion_ids")
    takes_extra, takes_metric = _accepts(fn, "log_extra"), _accepts(fn, "log_metric")

    def reward(
        completions: list[str],
        records: list[dict],
        conversations: list | None = None,
        completion_ids: list[list[int]] | None = None,
        log: RewardLog | None = None,
    ) -> list[float | None]:
        extra: dict[str, Any] = {}
        if completion_ids is not None and takes_ids:
            extra["completion_ids"] = completion_ids
        if log is not None and takes_extra:
            extra["log_extra"] = log.extra
        if log is not None and takes_metric:
            extra["log_metric"] = log.metric
        if conversations is not None:  # episodes: the opening messages, every message after them, the environment
            prompts = [c[0] for c in conversations]
            if chat:
                completions = [list(c[1]) for c in conversations]
            if takes_environments and len(conversations[0]) > 2:  # TRL's environments=: its own instances
                extra["environments"] = [getattr(c[2], "trl_instance", c[2]) for c in conversations]
        else:
            prompts = [prompt_of(r) for r in records]
            # TRL's rule (is_conversational): a prompt shown as chat messages gets its completion as the assistant's
            # message, a text prompt (every one in a plain-text run; a text row under --chat rows) a string
            completions = [[{"role": "assistant", "content": c}] if isinstance(p, list) else c
                           for p, c in zip(prompts, completions)]  # fmt: skip
        keys = [k for k in dict.fromkeys(k for r in records for k in r) if k not in reserved]
        fields = {k: [r.get(k) for r in records] for k in keys}
        return fn(prompts=prompts, completions=completions, **fields, **extra)  # awaitable for an async function

    reward.__name__ = getattr(fn, "__name__", type(fn).__name__)
    reward.takes_conversations = True
    reward.takes_completion_ids = takes_ids
    reward.takes_log = takes_extra or takes_metric
    reward.columns = getattr(fn, "columns", None)
    if reward.columns is None:
        reward.columns = declared_columns(fn)
    for hook in ("pop_counts", "start", "close"):  # what a reward function that owns a resource (a sandbox) has
        if callable(getattr(fn, hook, None)):
            setattr(reward, hook, getattr(fn, hook))
    return reward


class RewardLog:
    """What a reward function logs while scoring, through TRL's ``log_extra`` and ``log_metric`` keywords: extra
    columns of the logged completions (one value per completion scored) and scalar metrics (averaged over the step,
    logged under the name given)."""

    def __init__(self) -> None:
        self.columns: dict[str, list] = {}
        self.metrics: dict[str, list[float]] = {}

    def extra(self, column: str, values: list) -> None:
        self.columns.setdefault(column, []).extend(values)

    def metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))


# Parameters TRL itself passes to a reward function: not data columns.
TRL_ARGUMENTS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}


def _accepts(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes the keyword ``name`` (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


def declared_columns(fn: Callable) -> list[str]:
    """The data columns a TRL-form reward function asks for by name (parameters without a default)."""
    kinds = inspect.Parameter
    params = inspect.signature(fn).parameters.values()
    return [
        p.name
        for p in params
        if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
        and p.default is p.empty
        and p.name not in TRL_ARGUMENTS
    ]


def check_columns(reward_fns: Sequence[tuple[str, RewardFn, float]], records: list[dict], source: str) -> None:
    """A ConfigError naming the function and the column when a reward needs a column the records lack: a TRL-form
    function's named parameters, the built-in accuracy reward's ``ground_truth``."""
    from grpolab.config.train import ConfigError

    columns = list(dict.fromkeys(k for r in records for k in r))
    for name, fn, _ in reward_fns:
        missing = [c for c in getattr(fn, "columns", ()) if c not in columns]
        if not missing:
            continue
        what = (
            "the built-in accuracy reward needs"
            if fn is accuracy_reward
            else f"{getattr(fn, 'flag', '--reward-fn')} {name} declares the column(s)"
        )
        raise ConfigError(
            f"{what} {', '.join(map(repr, missing))}, which {source} lacks (columns: {', '.join(columns)})"
            + ("; pass --reward-fn" if fn is accuracy_reward else "")
        )


def load_reward_fn(path: str, given: Given = NOTHING) -> RewardFn:
    """Import ``"package.module:function"``; a clear error when it is not there."""
    from grpolab.common.loader import load_object
    from grpolab.config.train import ConfigError  # a ValueError: the CLI prints it as one line, not a traceback

    fn = load_object(path, "--reward-fn", "function", given)
    if not callable(fn):
        raise ConfigError(f"--reward-fn: {path!r} is not callable")
    try:
        reward_form(fn)
    except ValueError as e:
        raise ConfigError(f"--reward-fn {path}: {e}") from None
    return fn
