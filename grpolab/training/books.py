"""The books of a step: its metrics (``step_metrics``, ``env_metrics``) and its records (a line of
rollouts.jsonl, what a sample or a record shows of an episode), computed from the step's rollouts on every rank."""

from __future__ import annotations

import statistics

import torch

from grpolab.algo.groups import common_size, varies
from grpolab.data.records import question_of
from grpolab.env.credit import turn_rewards
from grpolab.rollout.collect import StepRollouts
from grpolab.rollout.episodes import EpisodeFacts


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
    lengths = torch.tensor(gen.length, dtype=torch.float)  # [every rollout generated]
    reward = torch.tensor(gen.reward)  # [every rollout generated]
    if any(gen.unscorable):  # rollouts every reward function declined have no reward: TRL's nanmean leaves them out
        reward = reward[~torch.tensor(gen.unscorable)]
    if common_size(sizes) is not None:
        group_std = torch.tensor(roll.rewards).std(dim=1, unbiased=False)  # [groups]
    else:
        group_std = torch.stack([torch.tensor(r).std(unbiased=False) for r in roll.rewards]) if sizes else None
    return {
        "reward/mean": reward.mean().item(),
        "reward/std": reward.std(unbiased=False).item(),
        "reward/group_std_mean": group_std.mean().item() if sizes else None,
        "reward/frac_zero_std": statistics.fmean(not varies(r) for r in roll.rewards) if sizes else None,
        "reward/accuracy": statistics.fmean(gen.accuracy),
        **({"reward/format": statistics.fmean(gen.format)} if gen.format is not None else {}),
        "reward/errors": gen.errors,
        **{f"reward/{k}": v for k, v in sorted(gen.counts.items())},  # the code reward's outcomes
        **{f"reward/{k}": mean_applied(v) for k, v in gen.components.items()},  # each --reward-fn, env
        **{f"reward/{k}/std": std_applied(v) for k, v in gen.components.items()},
        **{f"reward/logged/{k}": statistics.fmean(v) for k, v in gen.logged.items() if v},  # TRL's log_metric
        "sampling/rollouts": reward.numel(),
        "sampling/rollouts_total": rollouts_total,
        "sampling/rounds": roll.rounds,
        "sampling/kept_groups": len(sizes),
        "sampling/short": int(roll.short),
        "sampling/frac_zero_std_drawn": gen.zero_std,
        "sampling/group_size_mean": statistics.fmean(sizes) if sizes else 0.0,
        "sampling/group_size_max": max(sizes, default=0),
        **update,
        # mean over generated tokens; None when the engine gives no entropies (vllm)
        "policy/entropy": sum(gen.entropy_sum) / max(1.0, lengths.sum().item()) if gen.entropy_sum else None,
        "completion/len_mean": lengths.mean().item(),
        "completion/len_max": lengths.max().item(),
        "completion/len_min": lengths.min().item(),
        **finished_lengths(lengths, gen.truncated),
        "completion/truncated_frac": statistics.fmean(map(float, gen.truncated)),
        **(env_metrics(gen.episodes, gen.truncated) if gen.episodes is not None else {}),
        **times,
    }


def finished_lengths(lengths: torch.Tensor, truncated: list[bool]) -> dict:
    """``completion/done_len_{mean,min,max}``: the lengths of the completions that ended by themselves (not cut by
    the token limit) ``lengths`` ``[N]``; 0 when none did (as TRL's ``completions/*_terminated_length``)."""
    done = lengths[~torch.tensor(truncated, dtype=torch.bool)] if truncated else lengths
    done = done if done.numel() else torch.zeros(1)
    return {"completion/done_len_mean": done.mean().item(), "completion/done_len_min": done.min().item(),
            "completion/done_len_max": done.max().item()}  # fmt: skip


def std_applied(values: list) -> float | None:
    """The sample standard deviation (n - 1, TRL's ``nanstd``) of a component over the rollouts its function
    applied to; None when it applied to fewer than two."""
    kept = [v for v in values if v is not None]
    return statistics.stdev(kept) if len(kept) > 1 else None


def mean_applied(values: list) -> float | None:
    """The mean of a component over the rollouts its function applied to (TRL's nanmean: a None is left out); None
    when it applied to none."""
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


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
