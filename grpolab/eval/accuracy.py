"""Held-out accuracy: greedy, and sampled at a temperature over k samples per question.

Each accuracy comes with a 95% interval (:mod:`grpolab.common.stats`): Wilson's for greedy (one
Bernoulli trial per question), a clustered one for sampled (the question is the unit, its k
samples are not independent draws from the task). Per-category accuracies get the same.

Completions are drawn the way training draws rollouts, through a
:class:`grpolab.rollout.service.RolloutService`: its rollout engine and, for an environment task, its environment
(each question is then one episode, scored on its final conversation or by its return; the environment's reward
at each turn is reported as ``eval/stage<h>_*``).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable

from grpolab.common import streams
from grpolab.common.distributed import SINGLE, World, gather_concat
from grpolab.common.stats import clustered_accuracy_interval, default_pass_k, mean_ci, pass_at_k, wilson_interval
from grpolab.data.images import shown_images
from grpolab.data.records import question_of
from grpolab.rewards.builtin import accuracy_reward
from grpolab.rewards.rewarder import run_awaitables
from grpolab.rollout.engine import SamplingSettings
from grpolab.rollout.episodes import Episode


def _play(service, records: list[dict], keys, temperature, max_new_tokens, batch_size, tick):
    """Episodes (single-turn: completions) of ``records`` (``keys`` seed them), in batches of ``batch_size``."""
    episodes: list[Episode] = []
    settings = SamplingSettings(max_new_tokens, temperature)
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        episodes += service.play(chunk, keys[start : start + batch_size], settings)
        tick(len(chunk))
    return episodes


def episode_scores(episodes: list[Episode], records: list[dict], score) -> list[float]:
    """Each episode's score: ``score`` (a reward function) on its completion (and, for an episode, its conversation:
    TRL-form functions read it), or, with ``score`` None, its return as a share of its environment's ``max_return``."""
    texts = [e.text for e in episodes]
    if score is None:
        from grpolab.rollout.episodes import max_return

        return [sum(e.rewards) / max_return(e.env) for e in episodes]
    if episodes and episodes[0].env is not None and getattr(score, "takes_conversations", False):
        conversations = [(e.messages[: e.opening], e.messages[e.opening :], e.env) for e in episodes]
        got = score(texts, records, conversations=conversations)
    else:
        got = score(texts, records)
    if inspect.isawaitable(got):  # an async reward function (TRL's form too)
        got = run_awaitables([got])[0]
        if isinstance(got, BaseException):
            raise got
    return [0.0 if v is None else v for v in got]  # None ("does not apply": a gold answer that cannot be parsed): 0


def accuracy_summary(
    greedy_ok: list[float],
    sampled_ok: list[list[float]] | None,
    categories: list[str],
    pass_k: tuple[int, ...] = (),
) -> dict[str, float]:
    """Accuracies with 95% intervals, overall and per category.

    ``greedy_ok[i]`` is 1 if question i's greedy answer is right; ``sampled_ok[i]`` holds its k
    sampled outcomes (None: no sampled evaluation). Keys: ``eval/accuracy_greedy`` (+ ``_lo``,
    ``_hi``), ``eval/accuracy_sampled`` (+ ``_lo``, ``_hi``), ``eval/greedy_<cat>`` (+ bounds) and
    ``eval/sampled_<cat>`` (+ bounds); for 0/1 outcomes, ``eval/pass@<k>`` (+ bounds) for each k of ``pass_k``
    (default: :func:`grpolab.common.stats.default_pass_k` of the samples per question), :func:`pass_at_k_summary`.
    """
    out: dict[str, float] = {}
    # Rewards other than 0/1 (a reward function's mean): a normal interval of the mean, not a binomial one.
    binary = all(v in (0, 1) for v in greedy_ok) and all(v in (0, 1) for s in sampled_ok or [] for v in s)

    def add(greedy_key: str, sampled_key: str, idx: list[int]) -> None:
        g = [greedy_ok[i] for i in idx]
        out[greedy_key] = sum(g) / len(g)
        if binary:
            out[greedy_key + "_lo"], out[greedy_key + "_hi"] = wilson_interval(sum(g), len(g))
        else:
            _, out[greedy_key + "_lo"], out[greedy_key + "_hi"] = mean_ci(g)
        if sampled_ok is not None:
            per_q = [sum(sampled_ok[i]) / len(sampled_ok[i]) for i in idx]
            out[sampled_key] = sum(per_q) / len(per_q)
            if len(per_q) > 1:
                interval = clustered_accuracy_interval(per_q) if binary else mean_ci(per_q)[1:]
                out[sampled_key + "_lo"], out[sampled_key + "_hi"] = interval
            elif binary:  # one question: its k samples are the only trials there are
                out[sampled_key + "_lo"], out[sampled_key + "_hi"] = wilson_interval(
                    sum(sampled_ok[idx[0]]), len(sampled_ok[idx[0]])
                )
            else:
                _, out[sampled_key + "_lo"], out[sampled_key + "_hi"] = mean_ci(sampled_ok[idx[0]])

    add("eval/accuracy_greedy", "eval/accuracy_sampled", list(range(len(greedy_ok))))
    if sampled_ok and binary:
        out.update(pass_at_k_summary(sampled_ok, pass_k or default_pass_k(len(sampled_ok[0]))))
    by_cat: dict[str, list[int]] = defaultdict(list)
    for i, cat in enumerate(categories):
        by_cat[cat].append(i)
    for cat, idx in sorted(by_cat.items()):
        add(f"eval/greedy_{cat}", f"eval/sampled_{cat}", idx)
    return out


def pass_at_k_summary(sampled_ok: list[list[float]], ks: tuple[int, ...]) -> dict[str, float]:
    """``eval/pass@<k>`` for each k: the mean over questions of the unbiased pass@k of each question's n samples
    (:func:`grpolab.common.stats.pass_at_k`), with a 95% interval over questions (the question is the unit, as for the
    sampled accuracy). pass@1 is the sampled accuracy. A k above the samples per question is an error."""
    n = len(sampled_ok[0])
    out: dict[str, float] = {}
    for k in ks:
        if k > n:
            raise ValueError(f"pass@{k} needs at least {k} samples per question; the evaluation drew {n}")
        per_q = [pass_at_k(n, int(sum(s)), k) for s in sampled_ok]
        out[f"eval/pass@{k}"] = sum(per_q) / len(per_q)
        if len(per_q) > 1:
            out[f"eval/pass@{k}_lo"], out[f"eval/pass@{k}_hi"] = clustered_accuracy_interval(per_q)
    return out


def episode_metrics(per_episode: list[tuple[list[float], int]], name: str) -> dict[str, float]:
    """An evaluation's episodes, from each one's (rewards per turn, tool calls): ``eval/stage<h>_<name>``, the mean
    reward of turn h (0 for an episode that ended before it); ``eval/turns_<name>``, the mean number of replies;
    ``eval/tool_call_frac_<name>``, the share of episodes that called a tool."""
    H = max((len(r) for r, _ in per_episode), default=0)
    n = max(len(per_episode), 1)
    out = {f"eval/stage{h + 1}_{name}": sum(r[h] for r, _ in per_episode if len(r) > h) / n for h in range(H)}
    out[f"eval/turns_{name}"] = sum(len(r) for r, _ in per_episode) / n
    out[f"eval/tool_call_frac_{name}"] = sum(calls > 0 for _, calls in per_episode) / n
    return out


def _facts(episodes: list[Episode]) -> list[tuple[list[float], int]]:
    return [(list(e.rewards), e.counter("tool_calls")) for e in episodes]


def evaluate(
    service,
    records: list[dict],
    *,
    samples: int = 4,
    temperature: float = 1.0,
    max_new_tokens: int = 48,
    seed: int = 0,
    batch_size: int = 256,
    world: World = SINGLE,
    progress: Callable[[int, int], None] | None = None,
    score: Callable[[list[str], list[dict]], list[float]] | None = accuracy_reward,
    pass_k: tuple[int, ...] = (),
) -> tuple[dict[str, float], list[dict]]:
    """Accuracy on ``records``: the mean of ``score`` (default: the built-in answer check, 0 or 1) over the
    completions (an environment task's episodes) that ``service`` (a :class:`grpolab.rollout.service.RolloutService`)
    draws.

    Returns ``(metrics, examples)``: the keys of :func:`accuracy_summary` (greedy, and sampled
    over ``samples`` draws per question at ``temperature``, and pass@k for ``pass_k``); ``examples`` holds each question
    with its greedy completion and its fraction of correct samples. Sampling keys depend on
    ``seed`` and the question index only, so the same policy always gets the same score, on one
    process or split over ``world`` (each rank answers a block of the questions; every rank gets
    the totals). ``progress(done, total)`` is called after each generated batch with this
    process's count of completions.
    """
    model = service.policy.model
    was_training = model.training
    model.eval()
    mine = world.split(len(records))
    own = [records[i] for i in mine]
    total, done = len(own) * (1 + max(samples, 0)), 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    greedy_keys = [(streams.EVAL, seed, i) for i in mine]
    greedy = _play(service, own, greedy_keys, 0.0, max_new_tokens, batch_size, tick)
    greedy_ok = gather_concat(episode_scores(greedy, own, score), world)
    stages = {"greedy": gather_concat(_facts(greedy), world)}
    sampled_ok = None
    if samples > 0:
        rep = [r for r in own for _ in range(samples)]
        keys = [(streams.EVAL, seed, i, j) for i in mine for j in range(samples)]
        sampled = _play(service, rep, keys, temperature, max_new_tokens, batch_size, tick)
        flat = gather_concat(episode_scores(sampled, rep, score), world)  # question-major: `samples` per question
        sampled_ok = [flat[i * samples : (i + 1) * samples] for i in range(len(records))]
        stages["sampled"] = gather_concat(_facts(sampled), world)
    metrics = accuracy_summary(greedy_ok, sampled_ok, [r.get("category", "all") for r in records], pass_k)
    if service.multi_turn:
        for name, per_episode in stages.items():
            metrics.update(episode_metrics(per_episode, name))
    model.train(was_training)
    return metrics, _examples(records, gather_concat(_shown(greedy), world), greedy_ok, sampled_ok, score)


def _shown(episodes: list[Episode]) -> list[dict]:
    """What an example shows of each greedy episode: its completion, and an episode's conversation."""
    return [{"completion": e.text, **(_episode_shown(e) if e.env is not None else {})} for e in episodes]


def _episode_shown(e: Episode) -> dict:
    return {"conversation": e.messages, "opening": e.opening, "turn_rewards": list(e.rewards)}


def _examples(records, greedy, greedy_ok, sampled_ok, score) -> list[dict]:
    """Each question with its greedy completion (an episode: its conversation), outcome and sampled share."""
    samples = len(sampled_ok[0]) if sampled_ok else 0
    return [
        {
            "question": question_of(r),
            "ground_truth": r.get("ground_truth"),
            **shown_images(r),
            **g,
            "correct": bool(ok >= 1),
            **({} if score is accuracy_reward else {"reward": ok}),
            **({"sampled_correct": sum(s) / samples} if sampled_ok is not None else {}),
        }
        for r, g, ok, s in zip(records, greedy, greedy_ok, sampled_ok or [None] * len(records))
    ]


def format_accuracy(metrics: dict[str, float], prefix: str = "eval/accuracy_") -> str:
    """``greedy 0.120 [0.056, 0.240]  sampled 0.100 [0.051, 0.149]`` from :func:`accuracy_summary`'s keys."""
    parts = []
    for kind in ("greedy", "sampled"):
        key = prefix + kind
        if key in metrics:
            lo, hi = metrics.get(key + "_lo", float("nan")), metrics.get(key + "_hi", float("nan"))
            parts.append(f"{kind} {metrics[key]:.3f} [{lo:.3f}, {hi:.3f}]")
    ks = pass_ks(metrics)
    if len(ks) > 1:
        parts.append(" ".join(f"pass@{k} {metrics[f'eval/pass@{k}']:.3f}" for k in ks))
    return "  ".join(parts)


def pass_ks(metrics: dict) -> list[int]:
    """The k of the ``eval/pass@<k>`` keys in ``metrics``, ascending."""
    return sorted(
        int(key[len("eval/pass@") :])
        for key in metrics
        if key.startswith("eval/pass@") and key[-3:] not in ("_lo", "_hi")
    )
