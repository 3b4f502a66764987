"""Verifiable rewards [RLVR essay, Sec. 3.4]: r = accuracy + lambda * format.

A reward function is any callable ``(completions: list[str], records: list[dict])
-> list[float]``; ``records`` carry the ground truth. Functions written for TRL,
``(prompts, completions, **kwargs)`` with the record's fields as keyword arguments,
are adapted to that form by :func:`from_trl` (:func:`reward_form` tells the two
apart from the signature). :func:`score` runs a set of them so that one that
raises, or returns a non-finite value, costs only the rollouts it failed on
(reward 0, counted in ``errors``), never the run.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch

from grpolab import objects
from grpolab.answers import extract_final_number, math_equal, numbers_equal  # noqa: F401  (re-exported)
from grpolab.code_reward import code_reward  # noqa: F401  (re-exported: ``from grpolab.rewards import code_reward``)
from grpolab.data.records import prompt_of as prompt_of_record

RewardFn = Callable[[list[str], list[dict]], Sequence[float]]

# A well-formed final line: '#### <number>' and nothing after it but white space.
_FORMAT = re.compile(r"(?:^|\n)#### ?-?\d[\d,]*(?:\.\d+)?\.?[ \t]*\n?\s*$")


def accuracy_reward(completions: list[str], records: list[dict]) -> list[float]:
    """1 if the extracted answer equals ``record["ground_truth"]``, else 0.

    MATH-format records (``record["format"] == "math"``) are compared with math-verify.
    """
    out = []
    for c, r in zip(completions, records):
        if r.get("format") == "math":
            out.append(float(math_equal(c, str(r["ground_truth"]))))
        else:
            out.append(float(numbers_equal(extract_final_number(c), str(r["ground_truth"]))))
    return out


accuracy_reward.columns = ("ground_truth",)


def format_reward(completions: list[str], records: list[dict]) -> list[float]:
    """1 if the completion ends with a well-formed ``#### <number>`` line (MATH records: holds a ``\\boxed{}``), else 0."""
    return [
        float("\\boxed{" in c) if r.get("format") == "math" else float(bool(_FORMAT.search(c)))
        for c, r in zip(completions, records)
    ]


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
    required = [p for p in positional if p.default is p.empty]
    if (len(positional) >= 2 or var_pos) and len(required) <= 2:
        return "grpolab"
    raise ValueError(f"its signature {inspect.signature(fn)} fits neither accepted form: {ACCEPTED_FORMS}")


def from_trl(fn: Callable, prompt_of: Callable[[dict], Any], chat: bool) -> RewardFn:
    """A TRL-convention reward function as a grpolab one.

    It is called as TRL calls it: ``fn(prompts=..., completions=..., **fields)`` where
    every field of the records (``ground_truth``, ``answer``, your dataset's columns) is
    a keyword argument holding one value per completion. For chat runs, prompts are the
    message lists the model saw and completions ``[{"role": "assistant", "content": text}]``
    (TRL's conversational format); otherwise both are plain strings. A ``None`` in the
    result means "does not apply" in TRL and counts as 0 here, not as an error.
    """
    reserved = {"prompts", "completions", "prompt"}  # the prompt column arrives as ``prompts``, as in TRL

    def reward(completions: list[str], records: list[dict], conversations: list | None = None) -> list[float]:
        if conversations is not None:  # episodes: the opening messages, and every message after them
            prompts = [opening for opening, _ in conversations]
            if chat:
                completions = [list(rest) for _, rest in conversations]
        else:
            prompts = [prompt_of(r) for r in records]
            if chat:
                completions = [[{"role": "assistant", "content": c}] for c in completions]
        keys = [k for k in dict.fromkeys(k for r in records for k in r) if k not in reserved]
        fields = {k: [r.get(k) for r in records] for k in keys}
        values = fn(prompts=prompts, completions=completions, **fields)
        return [0.0 if v is None else v for v in values]

    reward.__name__ = getattr(fn, "__name__", "reward")
    reward.takes_conversations = True
    reward.columns = getattr(fn, "columns", None)
    if reward.columns is None:
        reward.columns = declared_columns(fn)
    if callable(getattr(fn, "pop_counts", None)):
        reward.pop_counts = fn.pop_counts
    return reward


# Parameters TRL itself passes to a reward function: not data columns.
TRL_ARGUMENTS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"}


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
    from grpolab.config import ConfigError

    columns = list(dict.fromkeys(k for r in records for k in r))
    for name, fn, _ in reward_fns:
        missing = [c for c in getattr(fn, "columns", ()) if c not in columns]
        if not missing:
            continue
        what = (
            "the built-in accuracy reward needs"
            if fn is accuracy_reward
            else f"--reward-fn {name} declares the column(s)"
        )
        raise ConfigError(
            f"{what} {', '.join(map(repr, missing))}, which {source} lacks (columns: {', '.join(columns)})"
            + ("; pass --reward-fn" if fn is accuracy_reward else "")
        )


def load_reward_fn(path: str) -> RewardFn:
    """Import ``"package.module:function"``; a clear error when it is not there."""
    from grpolab.config import ConfigError  # a ValueError: the CLI prints it as one line, not a traceback
    from grpolab.loader import load_object

    fn = load_object(path, "--reward-fn", "function")
    if not callable(fn):
        raise ConfigError(f"--reward-fn: {path!r} is not callable")
    try:
        reward_form(fn)
    except ValueError as e:
        raise ConfigError(f"--reward-fn {path}: {e}") from None
    return fn


# Metric names a reward function's own ``reward/<name>`` must not overwrite.
_RESERVED = {"mean", "std", "group_std_mean", "frac_zero_std", "accuracy", "format", "errors"}


def reward_functions(
    paths: Sequence[str],
    weights: Sequence[float],
    format_weight: float,
    prompt_of: Callable[[dict], Any] = prompt_of_record,
    chat: bool = False,
    episodes: bool = False,
) -> list[tuple[str, RewardFn, float]]:
    """The ``(name, fn, weight)`` a run scores with.

    No ``paths``: :func:`default_reward_fns` (``accuracy + format_weight * format``).
    Otherwise the functions at ``paths`` replace the accuracy reward: ``r = sum_i w_i f_i
    + format_weight * format`` (weights default to 1). Each is named by its function name
    (made unique; never one of the built-in metric names, except ``accuracy`` for the first),
    and the first plays the accuracy reward's part in ``reward/accuracy``.
    ``episodes`` (an environment task): the functions at ``paths`` only, no default and no format reward (the
    environment's own rewards add to theirs).
    """
    from grpolab.config import ConfigError

    if isinstance(paths, str):  # one path given as a string (the API; the CLI gives a tuple)
        paths = (paths,) if paths else ()
    if not paths:
        return [] if episodes else default_reward_fns(format_weight)
    weights = list(weights) or [1.0] * len(paths)
    if len(weights) != len(paths):
        raise ConfigError(f"--reward-weights: {len(weights)} weight(s) for {len(paths)} --reward-fn")
    out: list[tuple[str, RewardFn, float]] = []
    taken: set[str] = set()
    for i, (path, w) in enumerate(zip(paths, weights)):
        fn = load_reward_fn(path)
        if reward_form(fn) == "trl":
            fn = from_trl(fn, prompt_of, chat)
        base = objects.object_name(path)
        name, k = base, 2
        while name in taken or (name in _RESERVED and not (i == 0 and name == "accuracy")):
            name, k = f"{base}_{k}", k + 1
        taken.add(name)
        out.append((name, fn, float(w)))
    return out if episodes else out + [("format", format_reward, format_weight)]


def eval_reward(
    cfg, prompt_of: Callable[[dict], Any], chat: bool, reward_fns: Sequence[tuple[str, RewardFn, float]] = ()
) -> tuple[str, RewardFn]:
    """``(name, fn)`` of the reward whose mean is a run's held-out accuracy: ``--eval-reward-fn``; for prompt data
    (no built-in answer check) the first ``--reward-fn``; otherwise the built-in accuracy reward. ``reward_fns``: the
    run's, when already loaded; a function is only loaded when it is the one needed. An environment task without
    either has ``("env", None)``: its episodes' return, as a share of the environment's ``max_return``."""
    if cfg.eval_reward_fn:
        paths = (cfg.eval_reward_fn,)
    elif (cfg.format == "prompt" or cfg.multi_turn) and cfg.reward_fn:
        if reward_fns:
            return reward_fns[0][0], reward_fns[0][1]
        paths = tuple(cfg.reward_fn)[:1]
    elif cfg.multi_turn:
        return "env", None
    else:
        return "accuracy", accuracy_reward
    name, fn, _ = reward_functions(paths, (), 0.0, prompt_of=prompt_of, chat=chat)[0]
    return name, fn


class Scores(NamedTuple):
    total: torch.Tensor
    """``[N]`` weighted sum of the components."""
    components: dict[str, torch.Tensor]
    """name -> ``[N]`` unweighted values (0 where the function failed)."""
    errors: int
    """Number of (rollout, function) evaluations that raised or were non-finite."""
    counts: dict[str, float] = {}
    """What reward functions counted while scoring (their ``pop_counts()``, e.g. the code reward's outcomes)."""


def _call_safely(
    fn: RewardFn, completions: list[str], records: list[dict], conversations: list | None = None
) -> tuple[list[float], int]:
    """Values of ``fn``, with failures replaced by 0 and counted.

    The whole batch is tried first (cheap); if it raises or has the wrong length,
    each rollout is scored alone so only the failing ones lose their reward.
    ``conversations`` (episodes): each rollout's (opening messages, messages after them), for the functions that
    take them (TRL's form: its ``prompts`` and, for chat runs, ``completions``).
    """
    n = len(completions)
    takes = conversations is not None and getattr(fn, "takes_conversations", False)

    def call(idx: list[int]) -> list:
        args = ([completions[i] for i in idx], [records[i] for i in idx])
        return fn(*args, conversations=[conversations[i] for i in idx]) if takes else fn(*args)

    try:
        values = [float(v) for v in call(list(range(n)))]
        if len(values) != n:
            raise ValueError(f"returned {len(values)} values for {n} completions")
    except Exception:
        values = []
        for i in range(n):
            try:
                (v,) = call([i])
                values.append(float(v))
            except Exception:
                values.append(math.nan)
    errors = sum(1 for v in values if not math.isfinite(v))
    return [v if math.isfinite(v) else 0.0 for v in values], errors


def score(
    completions: list[str],
    records: list[dict],
    reward_fns: Sequence[tuple[str, RewardFn, float]],
    conversations: list | None = None,
) -> Scores:
    """Score ``N`` completions with weighted reward functions ``(name, fn, weight)`` (``conversations``: see
    :func:`_call_safely`)."""
    total = torch.zeros(len(completions))
    components: dict[str, torch.Tensor] = {}
    errors = 0
    counts: dict[str, float] = {}
    for name, fn, weight in reward_fns:
        pop = getattr(fn, "pop_counts", None)
        if callable(pop):
            pop()  # counted outside a score (an evaluation's): not this call's
        values, err = _call_safely(fn, completions, records, conversations)
        components[name] = torch.tensor(values, dtype=torch.float32)
        total += weight * components[name]
        errors += err
        if callable(pop):
            for k, v in pop().items():
                counts[k] = counts.get(k, 0) + v
    return Scores(total, components, errors, counts)


def default_reward_fns(format_weight: float = 0.1, accuracy_fn: RewardFn = accuracy_reward):
    """``r = accuracy + format_weight * format`` [RLVR essay, Sec. 3.4]."""
    return [("accuracy", accuracy_fn, 1.0), ("format", format_reward, format_weight)]


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (docs/references.md), scaled by ``penalty``: ``[N]``.

    0 for a completion of at most ``max_len - buffer`` tokens, then falling linearly to
    ``-penalty`` at ``max_len`` (the generation limit, so never beyond):
    ``min(0, -(length - (max_len - buffer)) / buffer) * penalty``, as verl's ``overlong_buffer``.
    """
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    exceed = lengths.float() - (max_len - buffer)
    return torch.clamp(-exceed / buffer, max=0.0) * penalty


@dataclasses.dataclass(frozen=True)
class Rewarder:
    """A run's reward: the weighted reward functions, plus DAPO's overlong penalty as one more component
    (``overlong``) when ``overlong_buffer`` > 0."""

    reward_fns: Sequence[tuple[str, RewardFn, float]]
    max_new_tokens: int = 0
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    @property
    def names(self) -> list[str]:
        """Component names; the first plays the accuracy reward's part (``reward/accuracy``)."""
        return [name for name, _, _ in self.reward_fns] + (["overlong"] if self.overlong_buffer else [])

    def __call__(
        self, completions: list[str], records: list[dict], lengths: torch.Tensor, conversations: list | None = None
    ) -> Scores:
        """Scores of ``N`` completions of ``lengths`` ``[N]`` tokens (``conversations``: episodes', see
        :func:`_call_safely`)."""
        scores = score(completions, records, self.reward_fns, conversations)
        if not self.overlong_buffer:
            return scores
        pen = overlong_penalty(lengths, self.max_new_tokens, self.overlong_buffer, self.overlong_penalty)
        return Scores(scores.total + pen, {**scores.components, "overlong": pen}, scores.errors, scores.counts)


def rewarder_for(cfg, policy) -> Rewarder:
    """A run's reward from its config (a resolved :class:`grpolab.config.TrainConfig`): its ``--reward-fn``
    functions and weights (TRL-form ones see prompts as ``policy`` shows them), the format reward and DAPO's
    overlong penalty. Training and the gradient probes both score with it."""
    fns = reward_functions(
        cfg.reward_fn,
        cfg.reward_weights,
        cfg.format_weight,
        chat=policy.chat,
        prompt_of=policy.shown_prompt,
        episodes=cfg.multi_turn,
    )
    return Rewarder(fns, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
