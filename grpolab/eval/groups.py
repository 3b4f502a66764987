"""A held-out evaluation in groups, as TRL's GRPOTrainer evaluates: G completions of each held-out prompt, scored with
the run's whole reward, and a training step's metrics of them, without the update.

TRL evaluates (``Trainer.evaluate``, its ``prediction_step``) batch by batch: each batch of prompts gets
``num_generations_eval`` completions a prompt, scored by every reward function and model, weighted; the batch's
rewards, completions and loss (in eval mode, before any update: every importance ratio is 1) are its metrics, and
the evaluation logs each one's mean over the batches. This is that evaluation through grpolab's rollout service:

1. the completions are drawn as training draws its rollouts (``service.sample``), completion j of question i from the
   stream ``(streams.EVAL, seed, i, j)`` (those of the sampled accuracy, :mod:`grpolab.eval.accuracy`), and scored
   by the run's :class:`grpolab.rewards.rewarder.Rewarder`;
2. a batch's metrics are a step's books (:mod:`grpolab.rollout.metrics`: ``reward/*``, ``completion/*``,
   ``policy/entropy``);
3. its loss is the objective's at ratio 1 (``loss/*``): the advantages of the run's estimator on the batch's groups,
   the policy term aggregated as the run aggregates it (:func:`grpolab.algo.loss.policy_loss`, logp = old logp: the
   sampler's log-probs), minus the entropy bonus. Not computed (no ``loss/*``) with a KL term (it needs the
   reference's log-probs), GDPO's normalize-then-sum, episodes, or an engine that gives no log-probs or entropies.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import NamedTuple

import torch

from grpolab.algo.advantages import STD_EPS, batch_std, estimator_for_scale, group_advantages
from grpolab.algo.entropy_bonus import entropy_bonus
from grpolab.algo.loss import entropy_threshold, high_entropy_mask, policy_loss
from grpolab.common import distributed as dist_
from grpolab.common import streams
from grpolab.common.distributed import SINGLE, World
from grpolab.rollout.collect import Generated, generated_of
from grpolab.rollout.engine import SamplingSettings
from grpolab.rollout.metrics import completion_metrics, reward_metrics, scored_rewards


@dataclasses.dataclass(frozen=True)
class RatioOneLoss:
    """What the loss at ratio 1 needs of a run's objective (``--estimator`` ... ``--entropy-coef``)."""

    options: dict
    """:func:`grpolab.algo.loss.policy_loss`'s options (the trainer's ``loss_options``), without a KL term."""
    estimator: str
    scale_rewards: str
    sample_std: bool
    mask_truncated: bool = False
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0


@dataclasses.dataclass(frozen=True)
class GroupSettings:
    """How a group evaluation draws and what it computes."""

    group_size: int
    """G: completions of each prompt (TRL's ``num_generations_eval``)."""
    batch_prompts: int
    """Prompts in one evaluation batch (TRL's ``per_device_eval_batch_size`` x processes / G)."""
    sampling: SamplingSettings
    seed: int
    loss: RatioOneLoss | None = None
    """None: no ``loss/*`` metrics."""


class GroupEvaluation(NamedTuple):
    """A group evaluation's results, batch by batch."""

    batches: list[dict]
    """Each batch's metrics: the books' ``reward/*``, ``sampling/rollouts``, ``policy/entropy``, ``completion/*``
    and (with a loss) ``loss/total``, ``loss/policy``, ``loss/clip_frac``, ``loss/clip_low_frac``,
    ``loss/clip_high_frac``, ``loss/clip_low_min``, ``loss/clip_high_max``."""
    rows: list[int]
    """Each batch's completions (B x G)."""
    seconds: float = 0.0
    """The evaluation's wall time."""


def group_evaluation(service, records: list[dict], settings: GroupSettings, world: World = SINGLE) -> GroupEvaluation:
    """TRL's evaluation of ``service``'s policy on ``records`` (module docstring), in batches of
    ``settings.batch_prompts`` prompts in their order; each rank draws a block of every batch's prompts, and every
    rank gets every batch's metrics. The policy is in eval mode meanwhile."""
    t0 = time.perf_counter()
    model = service.policy.model
    was_training = model.training
    model.eval()
    batches, rows = [], []
    with torch.no_grad():
        for start in range(0, len(records), settings.batch_prompts):
            chunk = list(range(start, min(start + settings.batch_prompts, len(records))))
            batches.append(_batch(service, records, chunk, settings, world))
            rows.append(len(chunk) * settings.group_size)
    model.train(was_training)
    return GroupEvaluation(batches, rows, time.perf_counter() - t0)


def _batch(service, records: list[dict], questions: list[int], settings: GroupSettings, world: World) -> dict:
    """One batch's metrics: questions ``questions`` (indices into ``records``), G completions each."""
    G = settings.group_size
    mine = [questions[i] for i in world.split(len(questions))]
    own = [records[i] for i in mine for _ in range(G)]
    keys = [(streams.EVAL, settings.seed, i, j) for i in mine for j in range(G)]
    rows, _, _ = service.sample(own, keys, settings.sampling)
    gen = Generated.merge(dist_.gather(generated_of(service, rows), world))  # every rank's, in question order
    groups = [gen.reward[k * G : (k + 1) * G] for k in range(len(questions))]  # [B][G]
    metrics = {**reward_metrics(gen, groups), "sampling/rollouts": scored_rewards(gen).numel()}
    metrics |= completion_metrics(gen)
    if settings.loss is None or service.multi_turn:
        return metrics
    parts = dist_.gather(_token_values(rows), world)  # every rank's, in question order
    if all(part is not None for part in parts):
        tokens = [t for part in parts for t in part]
        logprobs, entropies = [lp for lp, _ in tokens], [h for _, h in tokens]
        metrics |= ratio_one_loss(gen, G, logprobs, entropies, settings.loss)
    return metrics


def _token_values(rows) -> list[tuple[list[float], list[float]]] | None:
    """Each completion's sampling log-probs and entropies over its tokens (none on a rank without completions);
    None when the engine gives either none."""
    if rows.batch is None:
        return []
    if rows.logprobs is None or rows.entropy is None:
        return None
    mask = rows.batch.completion_mask.bool().cpu()  # [n, T]
    lp, ent = rows.logprobs.cpu(), rows.entropy.cpu()
    return [(lp[i][mask[i]].tolist(), ent[i][mask[i]].tolist()) for i in range(mask.shape[0])]


def ratio_one_loss(
    gen: Generated, G: int, logprobs: list[list[float]], entropies: list[list[float]], loss: RatioOneLoss
) -> dict:
    """The objective's loss on the batch ``gen`` (groups of ``G``) before any update (the policy that sampled is the
    one scored: logp = old logp, ratio 1), from each completion's sampling ``logprobs`` and ``entropies``: ``loss/total``
    (the policy term minus ``entropy_coef`` x the mean entropy), ``loss/policy`` and the clipped shares. Per-token
    values ``[N, T]`` are padded with 0 off each completion's tokens."""
    N = len(logprobs)
    T = max((len(x) for x in logprobs), default=0)
    lp, ent, mask = torch.zeros(N, T, dtype=torch.float64), torch.zeros(N, T, dtype=torch.float64), torch.zeros(N, T)
    for i, (a, h) in enumerate(zip(logprobs, entropies)):
        lp[i, : len(a)], ent[i, : len(h)], mask[i, : len(a)] = torch.tensor(a), torch.tensor(h), 1.0
    if loss.mask_truncated:  # DAPO: a completion cut at the token limit carries no loss
        mask = mask * (~torch.tensor(gen.truncated, dtype=torch.bool))[:, None].to(mask.dtype)
    selection = None
    if loss.top_entropy_quantile < 1.0:  # the policy term on the batch's highest-entropy tokens only
        selection = high_entropy_mask(ent, mask, entropy_threshold(ent[mask.bool()], loss.top_entropy_quantile))
    adv = _advantages(gen, G, loss)  # [N]
    total, stats = policy_loss(lp, lp, adv, mask, token_weights=selection, **loss.options)
    carried = mask if selection is None else mask * selection.to(mask.dtype)
    total = total - loss.entropy_coef * entropy_bonus(ent, carried, float(carried.sum()))
    return {
        "loss/total": total.item(),
        "loss/policy": stats["policy"].item(),
        "loss/clip_frac": stats["clip_frac"].item(),
        "loss/clip_low_frac": stats["clip_low"].item(),
        "loss/clip_high_frac": stats["clip_high"].item(),
        **{
            f"loss/{k}": None if math.isnan(stats[k].item()) else stats[k].item()
            for k in ("clip_low_min", "clip_high_max")
        },
    }


def _advantages(gen: Generated, G: int, loss: RatioOneLoss) -> torch.Tensor:
    """``[N]`` the run's advantages of the batch's groups (``--estimator``, ``--scale-rewards``, ``--reward-std``;
    a rollout without a reward: 0), as a training step computes them (``grpolab.training.credit``)."""
    rewards = torch.tensor(gen.reward, dtype=torch.float32)  # [N]
    unscorable = torch.tensor(gen.unscorable) if any(gen.unscorable) else None
    estimator = estimator_for_scale(loss.estimator, loss.scale_rewards)
    adv = group_advantages(rewards, [G] * (len(rewards) // G), estimator, loss.sample_std, unscorable)
    if loss.scale_rewards == "batch":
        adv = adv / (batch_std(rewards, sample=loss.sample_std) + STD_EPS)  # every reward of the batch
    return adv
