"""Credit across an episode's turns (``--advantage``): per-turn rewards -> per-turn advantages -> the advantage of
each of the policy's tokens, and the Monte Carlo state values ``rtg-mc`` subtracts [Foundations, Sec. 6].

The math is :func:`grpolab.algo.advantages.turn_advantages` and :func:`grpolab.algo.advantages.token_advantages`; this module
lays a step's episodes out for them. A turn's reward is what the environment's ``step`` gave it; the reward
functions (``--reward-fn``) score the final conversation, and their weighted sum counts as a reward of the last
turn.
"""

from __future__ import annotations

import dataclasses

import torch

from grpolab.algo.advantages import token_advantages, turn_advantages
from grpolab.algo.groups import offsets
from grpolab.common import streams


def turn_rewards(episode, final: float) -> list[float]:
    """The episode's reward at each turn, ``final`` (the reward functions' sum on its final conversation) added to
    the last."""
    r = list(episode.rewards) + [0.0] * (episode.turns - len(episode.rewards))
    if r:
        r[-1] += final
    return r


def _group_table(episodes: list, finals: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G, H]`` per-turn rewards (0 after an episode's end) and ``[G]`` turns of one group's episodes."""
    H = max([1, *(e.turns for e in episodes)])
    rewards = torch.zeros(len(episodes), H, dtype=torch.float64)
    for i, (e, final) in enumerate(zip(episodes, finals)):
        r = turn_rewards(e, final)
        rewards[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
    return rewards, torch.tensor([e.turns for e in episodes])


@dataclasses.dataclass
class EpisodeCredit:
    turns: list[torch.Tensor]
    """``[n]`` each rollout's advantage at each of its turns (``[H_i]``)."""
    token: torch.Tensor
    """``[m, T]`` the advantage of each of the policy's tokens in the rollouts' token rows (0 elsewhere)."""

    @property
    def first(self) -> torch.Tensor:
        """``[n]`` each rollout's advantage at its first turn (all turns', under ``grpo``)."""
        return torch.tensor([float(a[0]) if a.numel() else 0.0 for a in self.turns])


def episode_credit(
    rows, sizes: list[int], estimator: str, credit: str, values: list | None = None, sample_std: bool = False
) -> EpisodeCredit:
    """The credit of this rank's groups: ``rows`` (:class:`grpolab.rollout.rows.Rows` of episodes, group k's
    ``sizes[k]`` rollouts contiguous), ``values`` (rtg-mc: one ``[G, H]`` per group, :func:`mc_values`)."""
    turns: list[torch.Tensor] = []
    start = offsets(sizes)
    finals = rows.final.tolist()
    for k in range(len(sizes)):
        group = rows.episodes[start[k] : start[k + 1]]
        rewards, n_turns = _group_table(group, finals[start[k] : start[k + 1]])
        v = None if values is None else values[k]
        adv = turn_advantages(rewards, n_turns, estimator, credit, v, sample_std)  # [G, H]
        turns += [adv[i, : e.turns] for i, e in enumerate(group)]
    token = token_advantages(turns, rows.turn, rows.action, rows.counts) if rows.batch is not None else None
    return EpisodeCredit(turns, token)


def mc_values(service, rows, sizes: list[int], branches: int, settings, status=lambda text: None) -> list[torch.Tensor]:
    """rtg-mc's state values, one ``[G, H]`` per group: before turn 1, the mean return of the group's *other*
    episodes; before turn h >= 1, the mean reward-to-go of ``branches`` continuations of the episode from there,
    drawn and scored by ``service`` (:meth:`grpolab.rollout.service.RolloutService.branch`, ``.final_rewards``; 0
    where the episode ended before h)."""
    episodes, finals = rows.episodes, rows.final.tolist()
    start = offsets(sizes)
    H = max([1, *(e.turns for e in episodes)])
    values = []
    for k, G in enumerate(sizes):
        v = torch.zeros(G, H, dtype=torch.float64)
        group = range(start[k], start[k + 1])
        returns = torch.tensor([sum(turn_rewards(episodes[i], finals[i])) for i in group], dtype=torch.float64)
        v[:, 0] = (returns.sum() - returns) / max(G - 1, 1)  # s_1: the rest of the group
        values.append(v)
    for h in range(1, H):
        alive = [i for i, e in enumerate(episodes) if e.turns > h]
        if not alive:
            break
        status(f"rtg-mc: {len(alive) * branches} continuations from turn {h + 1}")
        reps = [episodes[i] for i in alive for _ in range(branches)]
        keys = [(streams.BRANCH, *episodes[i].key[1:], h, b) for i in alive for b in range(branches)]
        branched = service.branch(reps, h, keys, settings)
        branch_finals = service.final_rewards(branched).total
        rtg = torch.tensor(
            [sum(b.rewards[h:]) + float(f) for b, f in zip(branched, branch_finals)], dtype=torch.float64
        ).view(len(alive), branches)
        for j, i in enumerate(alive):
            k = next(k for k in range(len(sizes)) if start[k] <= i < start[k + 1])
            values[k][i - start[k], h] = rtg[j].mean()
    return values
