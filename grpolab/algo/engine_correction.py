"""When the engine that sampled and the trainer disagree: the mismatch, and the importance weights that correct it.

The policy gradient's expectation is over rollouts of the policy at sampling time, pi_old, whose
log-probs the trainer computes. A rollout engine that computes differently (another kernel, another
precision, vLLM's top-p sampling) samples from pi_engine instead, and the gradient estimate is
biased by the ratio of the two. Per token o_t of a completion, with the trainer's sampling-time
log-prob ``trainer_logp`` and the engine's ``engine_logp``:

    r_t = pi_old(o_t) / pi_engine(o_t) = exp(trainer_logp_t - engine_logp_t)

and per completion (over its loss-carrying tokens) R = prod_t r_t = exp(sum_t (trainer_logp_t -
engine_logp_t)). The weight multiplies each token's policy term (``policy_loss``'s
``token_weights``); a masked token keeps its place in the normalisers, as in TRL. Modes, with cap C > 1:

- ``none``: 1.
- ``token-truncate``: min(r_t, C) (truncated importance sampling; TRL's ``token_truncate``).
- ``token-mask``: 1 where 1/C <= r_t <= C, else 0 (rejection of the tokens the two disagree on most).
- ``sequence-truncate``: min(R, C), the same for every token of the completion.
- ``sequence-mask``: 1 where 1/C <= R <= C, else 0.

The weights are constants of the loss (no gradient flows through them).
"""

from __future__ import annotations

import torch

from grpolab.algo.names import CORRECTIONS  # noqa: F401 - re-exported


def engine_weights(
    trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> torch.Tensor:
    """``[N, T]`` weights of the policy term (0 where ``mask`` is 0), from log-probs ``[N, T]`` and ``mask`` ``[N, T]``."""
    if mode not in CORRECTIONS:
        raise ValueError(f"unknown engine correction {mode!r}; choose from {CORRECTIONS}")
    if not cap > 1:
        raise ValueError(f"the correction's cap must be > 1, got {cap}")
    m = mask.to(trainer_logp.dtype)
    if mode == "none":
        return m
    log_ratio = (trainer_logp - engine_logp).detach() * m  # [N, T], 0 on masked tokens
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(m)  # [N, T]: log R, the same on every token
    ratio = torch.exp(log_ratio)  # r or R; an overflow to inf is still capped to C, or masked
    if mode.endswith("truncate"):
        weights = ratio.clamp(max=cap)
    else:
        weights = ((ratio >= 1 / cap) & (ratio <= cap)).to(ratio.dtype)
    return torch.where(m.bool(), weights, torch.zeros_like(weights))


def mismatch(trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor) -> tuple[float, int, float]:
    """``(sum, count, max)`` of |trainer_logp - engine_logp| over the tokens of ``mask``: the parts of
    ``engine/logprob_diff_mean`` (sum / count over every rank) and ``engine/logprob_diff_max``."""
    diff = (trainer_logp - engine_logp).detach().abs()[mask.bool()]
    return float(diff.sum()), int(diff.numel()), float(diff.max()) if diff.numel() else 0.0
