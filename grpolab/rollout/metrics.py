"""The metrics of drawn rollouts, from their :class:`grpolab.rollout.collect.Generated` facts: their rewards (the total
and each component's) and their completions (lengths, truncation, entropy).

A training step's books (``grpolab.training.books``) and the held-out group evaluation (``grpolab.eval.groups``) both
report these, by the same formulas.
"""

from __future__ import annotations

import statistics

import torch

from grpolab.algo.groups import common_size, varies
from grpolab.rollout.collect import Generated


def scored_rewards(gen: Generated) -> torch.Tensor:
    """``[n]`` the rewards of the rollouts that have one: those every reward function declined (None) are left out,
    as TRL's nanmean leaves out their NaN."""
    reward = torch.tensor(gen.reward)  # [every rollout generated]
    return reward[~torch.tensor(gen.unscorable)] if any(gen.unscorable) else reward


def reward_metrics(gen: Generated, groups: list[list[float]]) -> dict:
    """``reward/*`` of the rollouts ``gen``, whose ``groups`` (each group's rewards) are those that count as groups:
    the mean and population std of the scored rewards, the groups' mean std and share of all-equal groups, the first
    function's mean (``reward/accuracy``), the format reward's, the errors, each component's mean and sample std over
    the rollouts it applied to, and what reward functions counted and logged."""
    sizes = [len(r) for r in groups]
    reward = scored_rewards(gen)
    if common_size(sizes) is not None:
        group_std = torch.tensor(groups).std(dim=1, unbiased=False)  # [groups]
    else:
        group_std = torch.stack([torch.tensor(r).std(unbiased=False) for r in groups]) if sizes else None
    return {
        "reward/mean": reward.mean().item(),
        "reward/std": reward.std(unbiased=False).item(),
        "reward/group_std_mean": group_std.mean().item() if sizes else None,
        "reward/frac_zero_std": statistics.fmean(not varies(r) for r in groups) if sizes else None,
        "reward/accuracy": statistics.fmean(gen.accuracy),
        **({"reward/format": statistics.fmean(gen.format)} if gen.format is not None else {}),
        "reward/errors": gen.errors,
        **{f"reward/{k}": v for k, v in sorted(gen.counts.items())},  # the code reward's outcomes
        **{f"reward/{k}": mean_applied(v) for k, v in gen.components.items()},  # each --reward-fn, env
        **{f"reward/{k}/std": std_applied(v) for k, v in gen.components.items()},
        **{f"reward/logged/{k}": statistics.fmean(v) for k, v in gen.logged.items() if v},  # TRL's log_metric
    }


def completion_metrics(gen: Generated) -> dict:
    """``policy/entropy`` (the sampler's mean entropy over the generated tokens; None when the engine gives none, as
    vLLM) and ``completion/*`` (lengths, those of the completions that ended by themselves, the truncated share)."""
    lengths = torch.tensor(gen.length, dtype=torch.float)  # [every rollout generated]
    return {
        "policy/entropy": sum(gen.entropy_sum) / max(1.0, lengths.sum().item()) if gen.entropy_sum else None,
        "completion/len_mean": lengths.mean().item(),
        "completion/len_max": lengths.max().item(),
        "completion/len_min": lengths.min().item(),
        **finished_lengths(lengths, gen.truncated),
        "completion/truncated_frac": statistics.fmean(map(float, gen.truncated)),
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
