"""A run's reward: its reward functions, weighted, run so that one that raises or returns a non-finite value costs
only the rollouts it failed on (reward 0, counted in ``errors``), never the run; plus DAPO's overlong penalty.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from grpolab.common.errors import RewardFunctionError
from grpolab.common.given import NOTHING, Given
from grpolab.config.rollout import RewardSection, SandboxSection
from grpolab.data.records import prompt_of as prompt_of_record
from grpolab.rewards.builtin import accuracy_reward, default_reward_fns, format_reward, overlong_penalty
from grpolab.rewards.code import CodeReward, CodeRewardSettings
from grpolab.rewards.forms import RewardFn, RewardLog, from_trl, load_reward_fn, reward_form
from grpolab.rewards.judge import JudgeSettings, load_judge
from grpolab.rewards.model import RewardModelSettings, load_reward_model, model_name

logger = logging.getLogger(__name__)

# Metric names a reward function's own ``reward/<name>`` must not overwrite.
_RESERVED = {"mean", "std", "group_std_mean", "frac_zero_std", "accuracy", "format", "errors", "judge_requests",
             "judge_cache_hits", "judge_failed", "judge_unanswered", "judge_failed_frac"}  # fmt: skip


def reward_functions(
    paths: Sequence[str],
    weights: Sequence[float],
    format_weight: float,
    prompt_of: Callable[[dict], Any] = prompt_of_record,
    chat: bool = False,
    episodes: bool = False,
    sandbox: SandboxSection | None = None,
    given: Given = NOTHING,
    models: Sequence[str] = (),
    model_settings: RewardModelSettings | None = None,
    judge: str = "",
    judge_settings: JudgeSettings | None = None,
    greedy: Callable | None = None,
) -> list[tuple[str, RewardFn, float]]:
    """The ``(name, fn, weight)`` a run scores with.

        No ``paths`` nor ``models``: :func:`default_reward_fns` (``accuracy + format_weight * format``).
        Otherwise the functions at ``paths``, then the reward models ``models`` (:mod:`grpolab.rewards.model`,
        loaded with ``model_settings``), then the LLM judge ``judge`` (:mod:`grpolab.rewards.judge`, answering from
        ``judge_settings``; a local judge model answers through ``greedy``,
        :func:`grpolab.rollout.engine.greedy_texts`) replace the accuracy reward: ``r = sum_i w_i f_i + format_weight * format``
        (``weights`` in that order, default 1). Each is named by its function's name or its model's (made unique;
        never one of the built-in metric names, except ``accuracy`` for the first), and the first plays the
        accuracy reward's part in ``reward/accuracy``.
        ``episodes`` (an environment task): these only, no default and no format reward (the
        environment's own rewards add to theirs). The code reward comes as a :class:`grpolab.rewards.code.CodeReward` of
        its own, with the ``sandbox`` options: whoever holds the functions closes it (:meth:`Rewarder.close`). ``given``:
    functions and models given to the Python API in place of names.
    """
    from grpolab.config.train import ConfigError

    if isinstance(paths, str):  # one path given as a string (the API; the CLI gives a tuple)
        paths = (paths,) if paths else ()
    judges = (judge,) if judge else ()
    if not paths and not models and not judges:
        return [] if episodes else default_reward_fns(format_weight)
    weights = _component_weights(weights, len(paths), len(models), bool(judge))
    out: list[tuple[str, RewardFn, float]] = []
    bases = [given.name_of(path) for path in paths] + [model_name(m) for m in models]
    names = metric_names(bases + [Path(j).stem for j in judges])
    for path, name, w in zip(paths, names, weights):
        fn = load_reward_fn(path, given)
        if isinstance(fn, CodeReward):  # this run's own, with its own sandbox
            fn = fn.for_run(CodeRewardSettings.of(sandbox) if sandbox is not None else fn.settings)
        if reward_form(fn) == "trl":
            fn = from_trl(fn, prompt_of, chat)
        out.append((name, fn, float(w)))
    settings = model_settings or RewardModelSettings()
    for spec, name, w in zip(models, names[len(paths) :], weights[len(paths) :]):
        out.append((name, load_reward_model(spec, settings, prompt_of, chat, given), float(w)))
    if judge:
        if judge_settings is None:
            raise ConfigError(f"--judge {judge}: needs --judge-model (a local model, or an endpoint's URL)")
        out.append((names[-1], load_judge(judge, judge_settings, prompt_of, names[-1], greedy), float(weights[-1])))
    return out if episodes else out + [("format", format_reward, format_weight)]


def _component_weights(weights: Sequence[float], functions: int, models: int, judge: bool) -> list[float]:
    """``weights`` (default: all 1), one for each of the reward components; a ConfigError counting them otherwise."""
    from grpolab.config.train import ConfigError

    count = functions + models + judge
    if not weights:
        return [1.0] * count
    if len(weights) != count:
        parts = [f"{functions} --reward-fn"] + ([f"{models} --reward-model"] if models else [])
        parts += ["a --judge"] if judge else []
        what = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
        raise ConfigError(f"--reward-weights: {len(weights)} weight(s) for {what}")
    return list(weights)


def metric_names(bases: list[str]) -> list[str]:
    """The names of reward functions with short names ``bases`` (``Given.name_of``), as their ``reward/<name>``
    metrics have them: made unique (``name_2``, ...), and never one of the built-in metric names, except ``accuracy``
    for the first."""
    out: list[str] = []
    for i, base in enumerate(bases):
        name, k = base, 2
        while name in out or (name in _RESERVED and not (i == 0 and name == "accuracy")):
            name, k = f"{base}_{k}", k + 1
        out.append(name)
    return out


def eval_reward(
    reward: RewardSection,
    eval_reward_fn: str,
    data_format: str,
    multi_turn: bool,
    prompt_of: Callable[[dict], Any],
    chat: bool,
    reward_fns: Sequence[tuple[str, RewardFn, float]] = (),
    sandbox: SandboxSection | None = None,
    given: Given = NOTHING,
) -> tuple[str, RewardFn]:
    """``(name, fn)`` of the reward whose mean is a run's held-out accuracy: ``eval_reward_fn``; for prompt data or
    episodes (no built-in answer check) the first of ``reward``'s functions (a reward model, without functions, when
    ``reward_fns`` holds it); otherwise the built-in accuracy reward. ``reward_fns``: the run's, when already
    loaded; a function is only loaded when it is the one needed (its caller then owns it: :func:`close_reward`;
    ``sandbox``: where a code reward's programs run). An environment task without either has ``("env", None)``: its
    episodes' return, as a share of the environment's ``max_return``."""
    if eval_reward_fn:
        paths = (eval_reward_fn,)
    elif (data_format == "prompt" or multi_turn) and reward_fns and (reward.reward_fn or reward.reward_model):
        return reward_fns[0][0], reward_fns[0][1]
    elif (data_format == "prompt" or multi_turn) and reward.reward_fn:
        paths = tuple(reward.reward_fn)[:1]
    elif multi_turn:
        return "env", None
    else:
        return "accuracy", accuracy_reward
    name, fn, _ = reward_functions(paths, (), 0.0, prompt_of=prompt_of, chat=chat, sandbox=sandbox, given=given)[0]
    return name, fn


class Scores(NamedTuple):
    total: torch.Tensor
    """``[N]`` weighted sum of the components."""
    components: dict[str, torch.Tensor]
    """name -> ``[N]`` unweighted values (0 where the function failed or returned None)."""
    errors: int
    """Number of (rollout, function) evaluations that raised or were non-finite."""
    counts: dict[str, float] = {}
    """What reward functions counted while scoring (their ``pop_counts()``, e.g. the code reward's outcomes)."""
    skipped: dict[str, torch.Tensor] = {}
    """name -> ``[N]`` bool, for a function that returned None for some rollouts: "does not apply" (TRL's meaning),
    0 in the total (TRL's nansum) and left out of the function's mean (TRL's nanmean)."""
    extra: list[dict] = []
    """Each rollout's extra columns, logged by reward functions with TRL's ``log_extra`` (empty: none logged)."""
    logged: dict[str, list[float]] = {}
    """Scalars reward functions logged with TRL's ``log_metric``, by name (the step logs each name's mean)."""
    unscorable: torch.Tensor | None = None
    """``[N]`` bool, when some rollout had None from every reward function: it has no reward (TRL's NaN): left out
    of its group's baseline and of the step's reward statistics, advantage 0. None: every rollout was scored."""

    def pick(self, idx) -> Scores:
        """The scores of the rollouts ``idx`` (counts and logged scalars stay the whole call's)."""
        idx = [int(i) for i in idx]
        return self._replace(
            total=self.total[idx],
            components={k: v[idx] for k, v in self.components.items()},
            skipped={k: v[idx] for k, v in self.skipped.items()},
            extra=[self.extra[i] for i in idx] if self.extra else [],
            unscorable=None if self.unscorable is None else self.unscorable[idx],
        )


def _caller(
    fn: RewardFn,
    completions: list[str],
    records: list[dict],
    conversations: list | None,
    completion_ids: list[list[int]] | None = None,
):
    """``call(idx, log)``: ``fn`` on the rollouts ``idx``, its result as it returns it (an awaitable for an async
    one). ``conversations`` (episodes): each rollout's (opening messages, messages after them, environment), for those
    that take them (TRL's form: its ``prompts`` and, for chat runs, ``completions``); ``completion_ids`` (each
    completion's tokens) and ``log`` (a :class:`RewardLog`) for those that take them (TRL's form)."""
    takes = conversations is not None and getattr(fn, "takes_conversations", False)
    takes_ids = completion_ids is not None and getattr(fn, "takes_completion_ids", False)
    takes_log = getattr(fn, "takes_log", False)

    def call(idx: list[int], log: RewardLog):
        args = ([completions[i] for i in idx], [records[i] for i in idx])
        kw: dict[str, Any] = {}
        if takes:
            kw["conversations"] = [conversations[i] for i in idx]
        if takes_ids:
            kw["completion_ids"] = [completion_ids[i] for i in idx]
        if takes_log:
            kw["log"] = log
        return fn(*args, **kw)

    return call


def run_awaitables(awaitables: list) -> list:
    """Await ``awaitables`` concurrently; each one's result, or the exception it raised. In a thread of its own when
    this one already runs an event loop (a notebook's): asyncio cannot nest loops."""

    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def _whole_batches(calls: list, n: int, logs: list[RewardLog]) -> list:
    """Each caller's result on all ``n`` rollouts (what it logs into ``logs[j]``), or the exception it raised; async
    functions' awaited together."""
    out, waiting = [], {}
    for j, call in enumerate(calls):
        try:
            got = call(list(range(n)), logs[j])
        except Exception as e:
            got = e
        if inspect.isawaitable(got):
            waiting[j] = got
        out.append(got)
    if waiting:  # none: no event loop at all (the usual, synchronous functions)
        for j, got in zip(waiting, run_awaitables(list(waiting.values()))):
            out[j] = got
    return out


class _Called(NamedTuple):
    values: list[float]
    """Each rollout's value: 0 where the function failed or returned None."""
    errors: int
    skipped: list[bool]
    """Where the function returned None ("does not apply")."""
    whole: bool
    """Whether one call on every rollout gave them all (else each was scored alone)."""


def _value(v) -> float:
    return math.nan if v is None else float(v)


def _call_safely(call, n: int, whole) -> _Called:
    """The values of a reward function on ``n`` rollouts, from ``whole`` (its result on all of them, or the exception
    it raised), with failures replaced by 0 and counted: if the whole batch raised or has the wrong length, each
    rollout is scored alone (``call([i], log)``) so only the failing ones lose their reward. A None is no failure: the
    function does not apply to that rollout (TRL's meaning)."""
    try:
        if isinstance(whole, BaseException):
            raise whole
        got = list(whole)
        values, skipped = [_value(v) for v in got], [v is None for v in got]
        if len(values) != n:
            raise ValueError(f"returned {len(values)} values for {n} completions")
        ok = True
    except RewardFunctionError:  # the function's own wrapper says: stop the run
        raise
    except Exception:
        values, skipped, ok = [], [], False
        for i in range(n):
            try:
                got = call([i], RewardLog())  # what it logs of one rollout is let go (see score)
                (v,) = run_awaitables([got])[0] if inspect.isawaitable(got) else got
                values.append(_value(v))
                skipped.append(v is None)
            except Exception:
                values.append(math.nan)
                skipped.append(False)
    errors = sum(1 for v, s in zip(values, skipped) if not s and not math.isfinite(v))
    return _Called([v if math.isfinite(v) else 0.0 for v in values], errors, skipped, ok)


def score(
    completions: list[str],
    records: list[dict],
    reward_fns: Sequence[tuple[str, RewardFn, float]],
    conversations: list | None = None,
    completion_ids: list[list[int]] | None = None,
) -> Scores:
    """Score ``N`` completions with weighted reward functions ``(name, fn, weight)`` (``conversations``,
    ``completion_ids``: see :func:`_caller`). Async functions (``async def``, TRL's form too) run concurrently with
    each other. What a function logs (TRL's ``log_extra``, ``log_metric``) is kept when its call on the whole batch
    succeeded."""
    n = len(completions)
    total = torch.zeros(n)
    components: dict[str, torch.Tensor] = {}
    skipped: dict[str, torch.Tensor] = {}
    extra: list[dict] = [{} for _ in range(n)]
    logged: dict[str, list[float]] = {}
    errors = 0
    counts: dict[str, float] = {}
    for _, fn, _ in reward_fns:
        pop = getattr(fn, "pop_counts", None)
        if callable(pop):
            pop()  # counted outside a score (an evaluation's): not this call's
    calls = [_caller(fn, completions, records, conversations, completion_ids) for _, fn, _ in reward_fns]
    logs = [RewardLog() for _ in reward_fns]
    wholes = _whole_batches(calls, n, logs)
    for (name, fn, weight), call, whole, log in zip(reward_fns, calls, wholes, logs):
        pop = getattr(fn, "pop_counts", None)
        called = _call_safely(call, n, whole)
        components[name] = torch.tensor(called.values, dtype=torch.float32)
        if any(called.skipped):
            skipped[name] = torch.tensor(called.skipped)
        total += weight * components[name]
        errors += called.errors
        if called.whole:
            for column, values in log.columns.items():
                for row, value in zip(extra, values):
                    row[column] = value
            for key, values in log.metrics.items():
                logged.setdefault(key, []).extend(values)
        for key in getattr(fn, "details", ()):  # what the function tells of each rollout beside its reward
            got = getattr(whole, "details", {}).get(key)
            components[key] = torch.tensor(got if got is not None and len(got) == n else [0.0] * n)
        if callable(pop):
            for k, v in pop().items():
                counts[k] = counts.get(k, 0) + v
    # grpolab's own format reward (beside a run's --reward-fn, weight 0 unless asked) is not one of the user's
    declined = [skipped.get(name) for name, fn, _ in reward_fns if fn is not format_reward]
    unscorable = None
    if declined and all(d is not None for d in declined):  # every function returned None somewhere
        every = torch.stack(declined).all(dim=0)  # [N]: where all of them did
        unscorable = every if bool(every.any()) else None
    if unscorable is not None:
        _warn_unscorable(records, completions, int(unscorable.nonzero()[0, 0]))
    return Scores(total, components, errors, counts, skipped, extra if any(extra) else [], logged, unscorable)


def _warn_unscorable(records: list[dict], completions: list[str], i: int) -> None:
    """TRL's warning (``_calculate_rewards``) on a rollout that every reward function returned None for, through
    :mod:`logging` on the first process, as TRL's: its row's columns, its prompt and its completion."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    row = {**records[i], "completion": completions[i]}
    logger.warning(
        f"All reward functions returned None for the following kwargs:\n{row}\n"
        "Please ensure that at least one reward function returns a valid reward."
    )


@dataclasses.dataclass(frozen=True)
class Rewarder:
    """A run's reward: the weighted reward functions, plus DAPO's overlong penalty as one more component
    (``overlong``) when ``overlong_buffer`` > 0."""

    reward_fns: Sequence[tuple[str, RewardFn, float]]
    max_new_tokens: int = 0
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    @property
    def weights(self) -> dict[str, float]:
        """Component name -> its weight in the total (the overlong penalty's: 1)."""
        return {name: w for name, _, w in self.reward_fns} | ({"overlong": 1.0} if self.overlong_buffer else {})

    @property
    def names(self) -> list[str]:
        """Component names; the first plays the accuracy reward's part (``reward/accuracy``)."""
        return [name for name, _, _ in self.reward_fns] + (["overlong"] if self.overlong_buffer else [])

    @property
    def details(self) -> list[str]:
        """The per-rollout values logged beside the components, weighted into nothing (a judge's criteria and
        failures: :class:`grpolab.rewards.judge.JudgeScores`)."""
        return [key for _, fn, _ in self.reward_fns for key in getattr(fn, "details", ())]

    def __call__(
        self,
        completions: list[str],
        records: list[dict],
        lengths: torch.Tensor,
        conversations: list | None = None,
        completion_ids: list[list[int]] | None = None,
    ) -> Scores:
        """Scores of ``N`` completions of ``lengths`` ``[N]`` tokens (``conversations``: episodes';
        ``completion_ids``: each completion's tokens; see :func:`_caller`)."""
        scores = score(completions, records, self.reward_fns, conversations, completion_ids)
        if not self.overlong_buffer:
            return scores
        pen = overlong_penalty(lengths, self.max_new_tokens, self.overlong_buffer, self.overlong_penalty)
        return scores._replace(total=scores.total + pen, components={**scores.components, "overlong": pen})

    def start(self, log=print) -> None:
        """Start what the reward functions run in (the code reward's sandbox: refused here, in one line, where
        programs cannot be isolated) and say how; nothing for functions that run in this process."""
        start_reward([fn for _, fn, _ in self.reward_fns], log)

    def close(self) -> None:
        """Stop what the reward functions started (the code reward's sandbox workers)."""
        close_reward([fn for _, fn, _ in self.reward_fns])


def start_reward(fns, log=print) -> None:
    """Start what any of ``fns`` (None entries skipped) runs its work in, and log how (:meth:`Rewarder.start`)."""
    for fn in fns:
        if callable(getattr(fn, "start", None)):
            log(fn.start())


def close_reward(fns) -> None:
    """Stop what any of ``fns`` (None entries skipped) started."""
    for fn in fns:
        if callable(getattr(fn, "close", None)):
            fn.close()


def rewarder_for(
    reward: RewardSection,
    policy,
    *,
    episodes: bool,
    max_new_tokens: int,
    sandbox: SandboxSection | None = None,
    given: Given = NOTHING,
    greedy: Callable | None = None,
) -> Rewarder:
    """A run's reward from its ``reward`` options: its ``--reward-fn`` functions and weights (TRL-form ones see
    prompts as ``policy`` shows them), the format reward and DAPO's overlong penalty over completions of up to
    ``max_new_tokens``, and its ``--reward-model`` models on their own device (:func:`model_settings`);
    ``episodes``: an environment task's (no default functions, no format reward); ``sandbox``: where a code reward's
    programs run; ``greedy``: what a local ``--judge-model`` answers through (the layer above passes
    :func:`grpolab.rollout.engine.greedy_texts`). Training and the gradient probes both score with it; it owns what
    its functions start (:meth:`Rewarder.close`)."""
    fns = reward_functions(
        reward.reward_fn,
        reward.reward_weights,
        reward.format_weight,
        chat=policy.chat,
        prompt_of=policy.shown_prompt,
        episodes=episodes,
        sandbox=sandbox,
        given=given,
        models=reward.reward_model,
        model_settings=model_settings(reward, policy) if reward.reward_model else None,
        judge=reward.judge,
        judge_settings=judge_settings(reward, policy) if reward.judge else None,
        greedy=greedy,
    )
    return Rewarder(fns, max_new_tokens, reward.overlong_buffer, reward.overlong_penalty)


def model_settings(reward: RewardSection, policy) -> RewardModelSettings:
    """Where and how ``reward``'s reward models run: --reward-model-device (default: ``policy``'s device), its
    dtype and token budget."""
    from grpolab.common.devices import resolve_device

    device = next(policy.model.parameters()).device
    if reward.reward_model_device:
        device = resolve_device(reward.reward_model_device)
    return RewardModelSettings(device, reward.reward_model_dtype, reward.reward_model_batch_tokens)


def judge_settings(reward: RewardSection, policy) -> JudgeSettings:
    """How ``reward``'s judge answers: its --judge-* options; a local judge model on --judge-device (default:
    ``policy``'s device)."""
    device = reward.judge_device or str(next(policy.model.parameters()).device)
    return JudgeSettings(
        model=reward.judge_model,
        engine=reward.judge_engine,
        served_model=reward.judge_served_model,
        api_key_env=reward.judge_api_key_env,
        failure_score=reward.judge_failure_score,
        concurrency=reward.judge_concurrency,
        timeout=reward.judge_timeout,
        retries=reward.judge_retries,
        batch_size=reward.judge_batch_size,
        cache=reward.judge_cache,
        device=device,
    )
