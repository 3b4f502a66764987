"""A step's credit: each rollout's advantage under --estimator and --scale-rewards, each of an episode's tokens' under
--advantage, and the advantages the loss is given (each prompt weighing 1/B when group sizes differ).

The math is ``grpolab.algo.advantages`` (per group, per turn) and ``grpolab.env.credit`` (an episode's turns laid out
for it); this module applies it to a step's rollouts. Groups are whole on each rank, so no baseline needs another
rank's rewards; --scale-rewards batch divides by the std of every reward of the update, which every rank holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpolab.algo.advantages import (
    STD_EPS,
    batch_standardise,
    batch_std,
    estimator_for_scale,
    group_advantages,
    normalize_then_sum,
)
from grpolab.algo.group_budget import prompt_weights
from grpolab.algo.groups import common_size
from grpolab.common import distributed as dist_
from grpolab.common.distributed import SINGLE, World
from grpolab.config.objective import ObjectiveSection
from grpolab.env.credit import episode_credit
from grpolab.rollout.collect import StepRollouts
from grpolab.training.step import Advantages


def step_advantages(
    roll: StepRollouts,
    objective: ObjectiveSection,
    device,
    values: Callable | None = None,
    reward_weights: dict[str, float] | None = None,
    world: World = SINGLE,
) -> Advantages:
    """This rank's advantages, group by group (``[n]``); for episodes also each policy token's (``[m, T]``) and
    each turn's. ``values(rows, sizes)``: rtg-mc's branched state values (``grpolab.env.credit.mc_values``).
    ``reward_weights``: each reward component's weight, for --reward-normalisation normalize-then-sum."""
    groups = roll.groups
    if objective.reward_normalisation == "normalize-then-sum":
        return Advantages(_decoupled(roll, reward_weights or {}, world).to(device))
    rewards = groups.rows.scores.total.to(device)  # [n]
    estimator = estimator_for_scale(objective.estimator, objective.scale_rewards)  # batch|none: from grpo
    scale = None
    if objective.scale_rewards == "batch" and roll.rewards:  # the std of every reward in the update, all ranks
        every = torch.tensor([r for g in roll.rewards for r in g])
        scale = batch_std(every, sample=objective.sample_std).to(device) + STD_EPS
    if groups.rows.episodes is not None:
        return _episode_advantages(roll, objective, estimator, device, scale, values)
    unscorable = groups.rows.scores.unscorable  # rollouts every reward function declined (None): no reward
    adv = group_advantages(rewards, groups.sizes, estimator, objective.sample_std, unscorable)  # [n]
    return Advantages(adv if scale is None else adv / scale)


def _decoupled(roll: StepRollouts, weights: dict[str, float], world: World) -> torch.Tensor:
    """GDPO's advantages ``[n]`` (float32): each reward component normalised per group, the weighted sum, divided by
    its std over the whole step (every rank's rollouts)."""
    rows = roll.groups.rows
    names = list(weights)
    if rows.n:
        comps = torch.stack([rows.scores.components[k].double() for k in names], dim=1)  # [n, K]
    else:
        comps = torch.zeros(0, len(names), dtype=torch.float64)
    summed = normalize_then_sum(comps, torch.tensor([weights[k] for k in names]), roll.groups.sizes)  # [n]
    total, total_sq, count = dist_.all_sum([float(summed.sum()), float(summed.pow(2).sum()), float(len(summed))], world)
    return batch_standardise(summed, total, total_sq, count).float()


def _episode_advantages(roll: StepRollouts, objective: ObjectiveSection, estimator: str, device, scale, values):
    """Episodes: each turn's advantage under --advantage (rtg-mc: with values from branched continuations)."""
    groups = roll.groups
    mc = values(groups.rows, groups.sizes) if objective.advantage == "rtg-mc" and groups.sizes else None
    credit = episode_credit(groups.rows, groups.sizes, estimator, objective.advantage, mc, objective.sample_std)
    first, token = credit.first.to(device), credit.token
    if scale is not None:
        first, token = first / scale, (None if token is None else token / scale.cpu())
    return Advantages(first, None if token is None else token.to(device), credit.turns)


def loss_advantages(roll: StepRollouts, adv: Advantages) -> torch.Tensor:
    """The advantages the loss uses (``[n]``, or ``[m, T]`` for episodes' token rows): with groups of different
    sizes (--sampling adaptive) each prompt still weighs 1/B in the step's mean
    (``grpolab.algo.group_budget.prompt_weights``); otherwise the advantages themselves."""
    values = adv.rollout if adv.token is None else adv.token
    sizes = [len(r) for r in roll.rewards]  # group sizes of the whole update (all ranks), in its order
    if not sizes or common_size(sizes) is not None:
        return values
    position = roll.positions
    factor = prompt_weights(sizes)
    groups = roll.groups
    w = torch.cat([torch.full((n,), factor[position[b]]) for b, n in zip(groups.prompt, groups.sizes)])
    if values.dim() == 2:  # token rows: each row takes its rollout's weight
        w = torch.repeat_interleave(w, torch.tensor(groups.rows.counts))[:, None]
    return values * w.to(values.device, values.dtype)


def cut_rows(rows) -> torch.Tensor | None:
    """``[m]`` (episodes) whether each token row's episode was cut by a limit (--mask-truncated drops them)."""
    if rows.episodes is None:
        return None
    cut = [e.cut for e, k in zip(rows.episodes, rows.counts) for _ in range(k)]
    return torch.tensor(cut or [False] * (rows.batch.completion_ids.shape[0] if rows.batch is not None else 0))
