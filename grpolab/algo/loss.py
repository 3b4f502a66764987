"""The clipped GRPO policy loss with an optional KL penalty to a reference policy.

Per token [RLVR essay, Sec. 3.3; U-statistic, App. A]::

    ratio = exp(logp - old_logp)
    term  = -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A) + beta * KL

and one named aggregation turns the masked ``[N, T]`` terms into a scalar.
Normalisers can be given for the whole batch so that a batch split into
micro-batches, each loss backpropagated, gives the gradient of the whole batch.

Variants (each off by default):

- ``importance_sampling="sequence"`` (GSPO): one ratio per rollout,
  ``s_i = exp(mean_t (logp - old_logp))`` over its tokens, clipped per rollout and
  broadcast to its tokens. At ``s_i = 1`` (the first update of a step) its gradient
  equals the token-level one for every aggregation: ``d s_i = s_i * mean_t d logp``, and
  the aggregation sums ``|o_i|`` copies of it with the weights of a token-level term.
  GSPO's paper clips much tighter (3e-4 below, 4e-4 above) than GRPO's 0.2.
- ``clip_delta`` (two-sided clipping): the unclipped ratio is capped at ``delta`` before
  the min, bounding the loss of a negative-advantage token whose ratio ran away
  (``delta > 1 + clip_high``, so positive advantages are unaffected).
- ``token_weights`` ``[N, T]``: multiplies the per-token policy term (not the KL term),
  e.g. the 0/1 mask of the highest-entropy tokens (:func:`high_entropy_mask`).
"""

from __future__ import annotations

import math

import torch

from grpolab.algo.names import AGGREGATIONS, IMPORTANCE_SAMPLING, KL_ESTIMATORS  # noqa: F401 - re-exported


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3)."""
    log_ratio = ref_logp - logp  # log pi_ref/pi
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.pow(2)
    if kind == "k3":  # unbiased and >= 0 [U-statistic, App. A, Eq. 13]
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; choose from {KL_ESTIMATORS}")


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    max_len: int | None = None,
    num_seqs: int | None = None,
    num_tokens: float | None = None,
) -> torch.Tensor:
    """Reduce masked per-token ``values`` ``[N, T]`` to a scalar.

    - ``seq-mean-token-mean``: (1/num_seqs) sum_i (sum_t m_it v_it / sum_t m_it)
      (GRPO's length normalisation, [RLVR essay, Sec. 3.3]);
    - ``token-mean``: sum_it m_it v_it / num_tokens;
    - ``seq-mean-token-sum-norm``: sum_it m_it v_it / (num_seqs * max_len) (Dr. GRPO).

    ``num_seqs`` and ``num_tokens`` default to this batch's; pass the whole
    batch's when ``values`` is one micro-batch of it. A rollout with no tokens
    contributes 0.
    """
    mask = mask.to(values.dtype)
    n = values.shape[0] if num_seqs is None else num_seqs
    masked = values * mask  # [N, T]
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)  # [N]
        return per_seq.sum() / n
    if mode == "token-mean":
        denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=values.dtype)
        return masked.sum() / denom.clamp(min=1.0)
    if mode == "seq-mean-token-sum-norm":
        T = values.shape[1] if max_len is None else max_len
        return masked.sum() / (n * T)
    raise ValueError(f"unknown aggregation {mode!r}; choose from {AGGREGATIONS}")


def aggregation_weights(
    mask: torch.Tensor,
    mode: str,
    *,
    max_len: int | None = None,
    num_seqs: int | None = None,
    num_tokens: float | None = None,
) -> torch.Tensor:
    """The per-token weights ``[N, T]`` (float64) that :func:`aggregate` puts on each value:
    ``aggregate(v, mask, mode, ...) == (v * aggregation_weights(mask, mode, ...)).sum()`` (up to rounding).

    The loss's gradient is ``sum_it w_it grad(term_it)``, so these are also the weights of each token's score
    in the gradient (``grpolab.probes.gram`` builds its per-rollout scores from them). ``num_seqs=1`` and
    ``num_tokens=1`` give the per-rollout scale, without the batch-wide constant; ``"sum"`` weighs every
    real token 1 (the plain trajectory score sum_t grad log pi, [Foundations, Eq. 17]).
    """
    m = mask.double()
    n = m.shape[0] if num_seqs is None else num_seqs
    if mode == "seq-mean-token-mean":
        return m / m.sum(dim=1, keepdim=True).clamp(min=1.0) / n
    if mode == "token-mean":
        return m / max(float(m.sum() if num_tokens is None else num_tokens), 1.0)
    if mode == "seq-mean-token-sum-norm":
        return m / float(n * (max_len or mask.shape[1]))
    if mode == "sum":
        return m
    raise ValueError(f"unknown aggregation {mode!r}; choose from {AGGREGATIONS}")


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio ``[N, 1]``: mean over each rollout's tokens of logp - old_logp
    (0 for a rollout with no tokens)."""
    m = mask.to(logp.dtype)
    return (((logp - old_logp) * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]


def entropy_threshold(entropies: torch.Tensor, quantile: float) -> torch.Tensor:
    """The entropy above which the top ``quantile`` fraction of tokens lies: the (1 - quantile)-quantile of
    ``entropies`` (1-D, the real tokens of the whole step), linear interpolation as ``torch.quantile``."""
    if entropies.numel() == 0:
        return torch.tensor(math.inf)
    return torch.quantile(entropies.double(), 1.0 - quantile).to(entropies.dtype)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, threshold: torch.Tensor | float) -> torch.Tensor:
    """1.0 on real tokens whose entropy is at least ``threshold`` (:func:`entropy_threshold`), else 0: ``[N, T]``."""
    return ((entropy >= threshold) & mask.bool()).to(entropy.dtype)


def loss_token_mask(
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
    eos_id: int,
    *,
    mask_truncated: bool = False,
    entropy: torch.Tensor | None = None,
    top_entropy_quantile: float = 1.0,
) -> torch.Tensor:
    """``[N, T]`` 1.0 on the tokens that carry policy loss, 0 elsewhere, for rollouts that are the whole step:
    ``mask_truncated`` drops rollouts with no ``eos_id`` (cut at the token limit, DAPO), and
    ``top_entropy_quantile < 1`` keeps only the tokens at or above the entropy threshold of the remaining ones.
    (The trainer applies the same two rules with the threshold taken over every rank's tokens.)"""
    carries = mask.bool()
    if mask_truncated:
        carries = carries & ((completion_ids == eos_id) & mask.bool()).any(dim=1, keepdim=True)
    out = carries.double()
    if top_entropy_quantile < 1.0:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the token entropies")
        out = out * high_entropy_mask(
            entropy.double(), carries, entropy_threshold(entropy[carries].double(), top_entropy_quantile)
        )
    return out


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    kl: str = "k3",
    aggregation: str = "seq-mean-token-mean",
    max_len: int | None = None,
    num_seqs: int | None = None,
    num_tokens: float | None = None,
    importance_sampling: str = "token",
    clip_delta: float | None = None,
    token_weights: torch.Tensor | None = None,
    token_values: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss (and the variants of the module docstring).

    Args:
        logp, old_logp, ref_logp, mask: ``[N, T]`` completion-token log-probs
            under the current, sampling-time and reference policies; ``mask`` 1 on
            real completion tokens.
        advantages: ``[N]`` (one per rollout, broadcast over tokens) or ``[N, T]``.
        num_seqs, num_tokens: whole-batch normalisers when this is a micro-batch.
        importance_sampling: ``"token"`` or ``"sequence"`` (GSPO).
        clip_delta: cap on the unclipped ratio (two-sided clipping); None = off.
        token_weights: ``[N, T]`` factors of the per-token policy term; None = all 1.
        token_values: also return the per-token values the loss used (below).

    Returns:
        ``(loss, stats)``; ``stats`` has ``policy`` (the clipped surrogate part),
        ``kl`` (mean per-token KL), ``clip_frac`` (share of tokens where the
        clipped branch was taken) and ``ratio_mean``. All stats are token means
        over unmasked tokens of this batch, detached. With ``token_values``, also the
        ``[N, T]`` values the loss used per token (:func:`_token_values`).
    """
    _check_shapes(logp=logp, old_logp=old_logp, mask=mask)
    if advantages.dim() == 1:
        advantages = advantages[:, None]  # [N, 1]: the same credit for every token [Foundations, Thm 3.1]
    advantages = advantages.to(logp.dtype)
    ratio = importance_ratio(logp, old_logp, mask, importance_sampling)  # [N, T] or [N, 1]
    surrogate, clipped_taken = clipped_surrogate(ratio, advantages, clip_low, clip_high, clip_delta)  # [N, T]
    if token_weights is not None:
        surrogate = surrogate * token_weights.to(surrogate.dtype)
    kl_tok = _kl_term(logp, ref_logp, kl) if beta != 0.0 else None  # [N, T]
    per_token = -surrogate if kl_tok is None else -surrogate + beta * kl_tok
    norms = dict(max_len=max_len, num_seqs=num_seqs, num_tokens=num_tokens)
    loss = aggregate(per_token, mask, aggregation, **norms)
    with torch.no_grad():
        policy = aggregate(-surrogate, mask, aggregation, **norms)
        values = _token_values(ratio, clipped_taken, advantages, mask) if token_values else {}
        return loss, _token_stats(policy, kl_tok, clipped_taken, ratio, mask.to(logp.dtype)) | values


def _kl_term(logp: torch.Tensor, ref_logp: torch.Tensor | None, kind: str) -> torch.Tensor:
    if ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")
    return kl_penalty(logp, ref_logp, kind)


def _token_values(ratio, clipped_taken, advantages, mask) -> dict[str, torch.Tensor]:
    """The loss's own per-token values ``[N, T]``, detached, 0 (False) off ``mask``: ``token_ratio`` (the importance
    ratio; GSPO's, broadcast per rollout), ``token_clipped`` (the clipped branch taken) and ``token_advantage`` (the
    advantage each token was credited)."""
    on = mask.bool()
    m = mask.to(ratio.dtype)
    return {
        "token_ratio": ratio.expand_as(m) * m,
        "token_clipped": clipped_taken.expand_as(on) & on,
        "token_advantage": advantages.expand_as(m) * m,
    }


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_delta: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate ``min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`` (the unclipped ``r`` capped
    at ``clip_delta`` if given) and where the clipped branch was taken (``clip(r) A < r A``). ``ratio`` ``[N, T]`` or
    ``[N, 1]``, ``advantages`` ``[N, 1]`` or ``[N, T]``; both results broadcast to ``[N, T]``."""
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    unclipped = (ratio if clip_delta is None else torch.clamp(ratio, max=clip_delta)) * advantages
    return torch.minimum(unclipped, clipped), clipped < unclipped


def _check_shapes(**tensors: torch.Tensor) -> None:
    shapes = {tuple(t.shape) for t in tensors.values()}
    if len(shapes) > 1:
        raise ValueError(" and ".join(f"{k} {tuple(t.shape)}" for k, t in tensors.items()) + " must match")


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """pi / pi_old per token (``"token"``: ``[N, T]``) or GSPO's per rollout (``"sequence"``: ``[N, 1]``, broadcast
    over the tokens)."""
    if level == "token":
        return torch.exp(logp - old_logp)  # [N, T]
    if level == "sequence":
        return torch.exp(sequence_log_ratio(logp, old_logp, mask))  # [N, 1]
    raise ValueError(f"unknown importance sampling level {level!r}; choose from {IMPORTANCE_SAMPLING}")


def _token_stats(policy, kl_tok, clipped_taken, ratio, m) -> dict[str, torch.Tensor]:
    """The loss's statistics: token means over the unmasked tokens ``m`` ``[N, T]`` (detached)."""
    n_tok = m.sum().clamp(min=1.0)
    return {
        "policy": policy,
        "kl": ((kl_tok if kl_tok is not None else torch.zeros_like(m)) * m).sum() / n_tok,
        "clip_frac": (clipped_taken.to(m.dtype).expand_as(m) * m).sum() / n_tok,
        "ratio_mean": (ratio.expand_as(m) * m).sum() / n_tok,
    }
