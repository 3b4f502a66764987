"""The books of a step: its metrics (``step_metrics``, ``env_metrics``) and its records (a line of
rollouts.jsonl, what a sample or a record shows of an episode), computed from the step's rollouts on every rank."""

from __future__ import annotations

import statistics

from grpolab.data.records import question_of
from grpolab.env.credit import turn_rewards
from grpolab.rollout.collect import StepRollouts
from grpolab.rollout.episodes import EpisodeFacts
from grpolab.rollout.metrics import completion_metrics, reward_metrics, scored_rewards


def rollout_record(b, g, rec, rows, tokens: list[int], adv, i: int, turn_adv=None) -> dict:
    """One line of rollouts.jsonl (rollout ``i`` of ``rows``)."""
    out = {
        "prompt": b,
        "rollout": g,
        "question": question_of(rec),
        "completion": rows.texts[i],
        "tokens": int(tokens[i]),
        "reward": None if _declined(rows.scores, i) else rows.scores.total[i].item(),
        "advantage": adv[i].item(),
    }
    if rows.scores.extra and rows.scores.extra[i]:
        out["extra"] = rows.scores.extra[i]  # the columns reward functions logged (TRL's log_extra)
    if rows.episodes is not None:
        out.update(episode_fields(rows, i))
        if turn_adv is not None:
            out["turn_advantages"] = [float(a) for a in turn_adv[i]]
    return out


def _declined(scores, i: int) -> bool:
    """Whether every reward function returned None for rollout ``i`` (it has no reward)."""
    return scores.unscorable is not None and bool(scores.unscorable[i])


def episode_fields(rows, i: int) -> dict:
    """What a record shows of episode ``i`` (nothing for a single-turn rollout): its conversation, its turns'
    rewards, whether a limit cut it."""
    if rows.episodes is None:
        return {}
    e = rows.episodes[i]
    return {
        "conversation": e.messages,
        "turn_rewards": turn_rewards(e, float(rows.final[i])),
        "cut": e.cut,
        **({"error": e.error} if e.error else {}),
    }


def step_metrics(roll: StepRollouts, rollouts_total: int, update: dict, times: dict) -> dict:
    """One step's metrics: rewards and sampling over every rollout generated (all ranks), then the update's, the
    completions' and the times (the observers add the probes' and the token credit's)."""
    gen = roll.generated
    sizes = [len(r) for r in roll.rewards]
    return {
        **reward_metrics(gen, roll.rewards),
        "sampling/rollouts": scored_rewards(gen).numel(),
        "sampling/rollouts_total": rollouts_total,
        "sampling/tokens": sum(gen.tokens),  # prompt and completion tokens of every rollout (TRL's num_tokens)
        "sampling/rounds": roll.rounds,
        "sampling/kept_groups": len(sizes),
        "sampling/short": int(roll.short),
        "sampling/frac_zero_std_drawn": gen.zero_std,
        "sampling/group_size_mean": statistics.fmean(sizes) if sizes else 0.0,
        "sampling/group_size_max": max(sizes, default=0),
        **update,
        **completion_metrics(gen),
        **(env_metrics(gen.episodes, gen.truncated) if gen.episodes is not None else {}),
        **times,
    }


def env_metrics(facts: EpisodeFacts, truncated: list[bool]) -> dict:
    """``env/*`` (and ``reward/stage<h>``) of a step's episodes (all ranks): their ``facts``, and whether a limit
    cut each (``truncated``)."""
    n = max(len(facts.turns), 1)
    H = max(facts.turns, default=0)
    return {
        "env/turns_mean": sum(facts.turns) / n,
        "env/turns_max": H,
        "env/truncated": sum(map(float, truncated)) / n,
        "env/tool_calls": sum(facts.tool_calls),
        "env/tool_call_frac": sum(c > 0 for c in facts.tool_calls) / n,
        "env/tool_errors": sum(facts.tool_errors),
        "env/tool_truncated": sum(facts.tool_truncated),
        "env/errors": sum(facts.env_errors),
        **{f"reward/stage{h + 1}": sum(r[h] for r in facts.turn_rewards if len(r) > h) / n for h in range(H)},
    }
