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
- ``off_policy_threshold`` (DeepSeek-V3.2's off-policy sequence mask): a rollout with a negative
  advantage whose mean per-token log pi_sampling - log pi exceeds the threshold carries no policy term
  (:func:`off_policy_mask`).
- ``kl_ratio`` (TRL's ``use_bias_correction_kl``): each token's KL estimate is multiplied by the importance ratio
  the policy term uses (the token's, or GSPO's per rollout), unclipped and differentiated through: the samples come
  from the sampling-time policy, and the ratio reweighs them to the current one.

The per-token policy term itself is one of ``loss_type`` (:func:`policy_term`; docs/loss-variants.md has each
formula and its source):

- ``clip`` (the default): PPO/GRPO's clipped surrogate above;
- ``cispo`` (MiniMax-M1): ``sg(min(ratio, cispo_cap)) * A * logp``: the importance weight is truncated and
  detached, so every token keeps a gradient (``min(ratio, cap) * A * grad logp``) however far its ratio ran;
- ``sapo`` (Qwen's SAPO): ``(4 / tau) * sigmoid(tau * (ratio - 1)) * A``, a smooth gate in place of the clip
  (tau_pos for A > 0, tau_neg otherwise); its gradient at ratio 1 is GRPO's;
- ``luspo``: the clipped surrogate summed over each rollout's tokens (aggregation ``seq-mean-token-sum``): GSPO's
  sequence loss scaled by the rollout's length (the caller picks the aggregation: ObjectiveSection.loss_aggregation);
- ``vespo``: ``sg(phi(w)) * A * logp`` with w = prod_t ratio_t the rollout's whole importance weight and
  ``phi(w) = exp(lambda + k log w - lambda w)`` (k, lambda by the advantage's sign; phi(1) = 1).

At ratio 1 (the first pass of a step, mu = 1) every one of them has GRPO's gradient ``A grad logp`` per token
(cispo: when cispo_cap >= 1); they differ only once the weights have moved (mu > 1, or a sampler that computes
other probabilities).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from grpolab.algo.names import AGGREGATIONS, IMPORTANCE_SAMPLING, KL_ESTIMATORS, LOSS_TYPES  # noqa: F401 - re-exported


@dataclasses.dataclass(frozen=True)
class TermParams:
    """The constants of the policy terms other than ``clip``: cispo's cap, sapo's gate temperatures, vespo's gamma
    shape (k and lambda for each sign of the advantage). Built from the run's options by
    :meth:`grpolab.config.objective.TermSection.term_params`, which holds their defaults and documents each: the math
    does not import the config, and keeps no defaults of its own."""

    cispo_cap: float
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float


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


def effective_aggregation(loss_type: str, aggregation: str) -> str:
    """The aggregation a run's loss uses: ``aggregation``, or ``seq-mean-token-sum`` for luspo (GSPO's sequence loss
    scaled by the rollout's length: each rollout's terms summed)."""
    return "seq-mean-token-sum" if loss_type == "luspo" else aggregation


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
    - ``seq-mean-token-sum-norm``: sum_it m_it v_it / (num_seqs * max_len) (Dr. GRPO);
    - ``seq-mean-token-sum``: sum_it m_it v_it / num_seqs (LUSPO: each rollout's terms summed, not averaged).

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
    if mode == "seq-mean-token-sum":
        return masked.sum() / n
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
    if mode == "seq-mean-token-sum":
        return m / n
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
    loss_type: str = "clip",
    params: TermParams | None = None,
    off_policy_threshold: float | None = None,
    sampling_logp: torch.Tensor | None = None,
    kl_ratio: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss (and the variants of the module docstring).

    Args:
        logp, old_logp, ref_logp, mask: ``[N, T]`` completion-token log-probs under the current, sampling-time
            and reference policies; ``mask`` 1 on real completion tokens.
        advantages: ``[N]`` (one per rollout, broadcast over tokens) or ``[N, T]``.
        num_seqs, num_tokens: whole-batch normalisers when this is a micro-batch; importance_sampling: ``"token"``
        or ``"sequence"`` (GSPO); clip_delta: the unclipped ratio's cap (None: off).
        token_weights: ``[N, T]`` factors of the policy term (None: 1); token_values: return the loss's token values;
        loss_type, params, off_policy_threshold: :func:`policy_term`, its constants, :func:`off_policy_mask`'s.
        kl_ratio: each token's KL times its importance ratio (TRL's ``use_bias_correction_kl``; so is the stat).

    Returns ``(loss, stats)``; ``stats``: ``policy`` (the policy term's part), ``kl`` (mean per-token KL), ``clip_frac``
    (tokens where the clipped branch was taken; cispo: the weight truncated), ``clip_low`` and ``clip_high`` (each
    side's share: :func:`clip_sides`), ``ratio_mean``: token means over the batch's unmasked tokens, detached; with
    ``token_values``, :func:`_token_values`.
    """
    _check_shapes(logp=logp, old_logp=old_logp, mask=mask)
    # [N, 1] for per-rollout advantages: the same credit for every token [Foundations, Thm 3.1]
    advantages = (advantages[:, None] if advantages.dim() == 1 else advantages).to(logp.dtype)
    ratio = importance_ratio(logp, old_logp, mask, importance_sampling)  # [N, T] or [N, 1]
    surrogate, clipped_taken = policy_term(
        loss_type, logp, old_logp, advantages, mask, ratio, clip_low, clip_high, clip_delta, params
    )  # [N, T]
    if off_policy_threshold is not None:
        sampled = old_logp if sampling_logp is None else sampling_logp  # [N, T] what the sampler scored
        token_weights = _with_off_policy_mask(token_weights, off_policy_threshold, advantages, logp, sampled, mask)
    if token_weights is not None:
        surrogate = surrogate * token_weights.to(surrogate.dtype)
    kl_tok = _kl_term(logp, ref_logp, kl, ratio if kl_ratio else None) if beta != 0.0 else None  # [N, T]
    norms = dict(max_len=max_len, num_seqs=num_seqs, num_tokens=num_tokens)
    loss = aggregate(-surrogate if kl_tok is None else -surrogate + beta * kl_tok, mask, aggregation, **norms)
    with torch.no_grad():
        policy, m = aggregate(-surrogate, mask, aggregation, **norms), mask.to(logp.dtype)
        values = _token_values(ratio, clipped_taken, advantages, mask) if token_values else {}
        stats = _token_stats(policy, kl_tok, clipped_taken, ratio, m)
        return loss, stats | clip_sides(ratio, advantages, clip_low, clip_high, m) | values


def logp_weights(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, **loss_options
) -> torch.Tensor:
    """``[N, T]`` float64: d loss / d logp_it, the weight of each token's score grad log pi(o_it) in the gradient of
    :func:`policy_loss` (with ``loss_options``): grad L = sum_it w_it grad logp_it, for any loss type, aggregation and
    ratio. So the per-rollout gradient rows the probes take the spectrum of are ``sum_t w_it grad logp_it`` (the Gram
    matrix of ``grpolab.probes.gram.score_gram`` with these weights), whatever the objective; at ratio 1 with the
    clip they are -A_i times the aggregation's weights. (The KL term, if ``beta`` is given, is included.)"""
    leaf = logp.detach().double().requires_grad_(True)
    loss, _ = policy_loss(leaf, old_logp.detach().double(), advantages.detach().double(), mask, **loss_options)
    (w,) = torch.autograd.grad(loss, leaf)
    return w


def policy_term(
    loss_type: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ratio: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_delta: float | None,
    params: TermParams | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token policy term to maximise ``[N, T]`` of ``loss_type`` and where it was clipped (truncated): the
    one dispatch over the objectives of the module docstring. ``ratio``: :func:`importance_ratio`'s."""
    if loss_type in ("clip", "luspo"):  # luspo differs by its aggregation only
        return clipped_surrogate(ratio, advantages, clip_low, clip_high, clip_delta)
    if params is None and loss_type in LOSS_TYPES:
        raise ValueError(f"loss type {loss_type!r} needs its constants: params=TermSection(...).term_params()")
    if loss_type == "cispo":
        return cispo_term(ratio, logp, advantages, params.cispo_cap)
    if loss_type == "sapo":
        return sapo_term(ratio, advantages, params.sapo_temperature_pos, params.sapo_temperature_neg)
    if loss_type == "vespo":
        phi = vespo_weight(logp - old_logp, mask, advantages, params)  # [N, 1] (or [N, T] per-token advantages)
        return phi * advantages * logp, torch.zeros_like(logp, dtype=torch.bool)
    raise ValueError(f"unknown loss type {loss_type!r}; choose from {LOSS_TYPES}")


def cispo_term(
    ratio: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO [MiniMax-M1, Eq. 4]: ``sg(min(ratio, cap)) * A * logp`` ``[N, T]``, and where the weight was truncated
    (``ratio > cap``). The weight is a constant to autograd: the gradient is ``min(ratio, cap) * A * grad logp`` on
    every token, the clipped ones included (PPO's clip zeroes theirs)."""
    weight = torch.clamp(ratio, max=cap).detach()
    return weight * advantages * logp, (ratio > cap).expand_as(logp)


def sapo_term(
    ratio: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SAPO's soft gate: ``(4 / tau) * sigmoid(tau * (ratio - 1)) * A`` ``[N, T]``, tau = ``tau_pos`` where A > 0,
    else ``tau_neg``. d/dratio = 4 s (1 - s) A (s the sigmoid): A at ratio 1 (GRPO's gradient), falling smoothly
    to 0 as the ratio leaves 1, faster for larger tau. Nothing is clipped (the flag is all False)."""
    tau = _by_sign(advantages > 0, tau_pos, tau_neg, ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    term = gate * advantages
    return term, torch.zeros_like(term, dtype=torch.bool)


@torch.no_grad()
def vespo_weight(
    log_ratio: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, params: TermParams
) -> torch.Tensor:
    """VESPO's gamma weight ``phi(w) = exp(lambda + k log w - lambda w)`` of the rollout's importance weight
    ``w = exp(sum_t log_ratio_t)`` (a product over its tokens, not GSPO's geometric mean), detached: ``[N, 1]``
    (``[N, T]`` for per-token advantages). k, lambda are the ``_pos`` constants where A >= 0, else ``_neg``;
    phi(1) = 1, and phi falls off on both sides (as w^k below 1, as exp(-lambda w) above). As TRL computes it:
    each token's log-ratio clamped to [-20, 20], log w to [log 1e-8, 20], a non-finite phi set to 0."""
    m = mask.to(log_ratio.dtype)
    log_w = (log_ratio.clamp(-20.0, 20.0) * m).sum(-1, keepdim=True).clamp(math.log(1e-8), 20.0)  # [N, 1]
    nonneg = advantages >= 0
    k = _by_sign(nonneg, params.vespo_k_pos, params.vespo_k_neg, log_w.dtype)
    lam = _by_sign(nonneg, params.vespo_lambda_pos, params.vespo_lambda_neg, log_w.dtype).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _by_sign(positive: torch.Tensor, if_pos: float, if_not: float, dtype: torch.dtype) -> torch.Tensor:
    """``if_pos`` where ``positive``, else ``if_not``, in ``dtype`` (torch.where of two Python floats would round
    them to float32 first)."""
    return torch.where(positive, torch.tensor(if_pos, dtype=dtype), torch.tensor(if_not, dtype=dtype))


def off_policy_mask(
    advantages: torch.Tensor, logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask [DeepSeek-V3.2, Eq. 9]: 0 for a rollout with A < 0 whose mean
    per-token ``sampling_logp - logp`` (an estimate of KL(pi_sampling || pi)) exceeds ``threshold``, else 1:
    ``[N, 1]`` (``[N, T]`` for per-token advantages), detached. Tokens whose sampler log-prob is NaN count 0."""
    m = mask.to(logp.dtype)
    gap = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)  # [N, T]
    mean_gap = (gap * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)  # [N, 1]
    return ((advantages >= 0) | (mean_gap <= threshold)).to(logp.dtype)


def _with_off_policy_mask(token_weights, threshold, advantages, logp, sampled, mask):
    """``token_weights`` (None: all 1) times :func:`off_policy_mask` against the sampler's log-probs ``sampled``."""
    keep = off_policy_mask(advantages, logp, sampled, mask, threshold)  # [N, 1]
    return keep if token_weights is None else token_weights * keep


def _kl_term(logp: torch.Tensor, ref_logp: torch.Tensor | None, kind: str, ratio=None) -> torch.Tensor:
    """``[N, T]`` the KL estimate, times ``ratio`` (``kl_ratio``: as TRL, the raw importance ratio before clip_delta,
    ``[N, T]`` or ``[N, 1]``, with its gradient)."""
    if ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")
    out = kl_penalty(logp, ref_logp, kind)
    return out if ratio is None else out * ratio


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
    """pi / pi_old per token (``"token"``: ``[N, T]``), GSPO's per rollout (``"sequence"``: ``[N, 1]``, the mean
    log-ratio's, broadcast over the tokens) or the rollout's whole ratio (``"sequence-sum"``: ``[N, 1]``,
    prod_t pi / pi_old, as TRL's RLOOTrainer clips it)."""
    if level == "token":
        return torch.exp(logp - old_logp)  # [N, T]
    if level == "sequence":
        return torch.exp(sequence_log_ratio(logp, old_logp, mask))  # [N, 1]
    if level == "sequence-sum":
        m = mask.to(logp.dtype)
        return torch.exp(((logp - old_logp) * m).sum(-1, keepdim=True))  # [N, 1]
    raise ValueError(f"unknown importance sampling level {level!r}; choose from {IMPORTANCE_SAMPLING}")


def clip_sides(ratio, advantages, clip_low: float, clip_high: float, m) -> dict[str, torch.Tensor]:
    """The token shares below the clip range with a negative advantage (``clip_low``) and above it with a positive
    one (``clip_high``): where PPO's clip binds on each side, as TRL's ``clip_ratio/low_mean`` and ``high_mean`` count
    them (token means over the unmasked tokens ``m`` ``[N, T]``, detached); and the least and greatest share of one
    rollout (``clip_low_min``, ``clip_high_max``: TRL's ``low_min`` and ``high_max``, over the rollouts with a token;
    NaN without one)."""
    n_tok = m.sum().clamp(min=1.0)
    low = (ratio < 1 - clip_low).logical_and(advantages < 0).to(m.dtype).expand_as(m) * m  # [N, T]
    high = (ratio > 1 + clip_high).logical_and(advantages > 0).to(m.dtype).expand_as(m) * m
    has = m.sum(1) > 0  # [N] rollouts with a token
    per_row = (torch.stack([low.sum(1), high.sum(1)]) / m.sum(1).clamp(min=1.0))[:, has]  # [2, rows with a token]
    nan = torch.tensor(float("nan"), dtype=m.dtype, device=m.device)
    return {"clip_low": low.sum() / n_tok, "clip_high": high.sum() / n_tok,
            "clip_low_min": per_row[0].min() if has.any() else nan,
            "clip_high_max": per_row[1].max() if has.any() else nan}  # fmt: skip


def _token_stats(policy, kl_tok, clipped_taken, ratio, m) -> dict[str, torch.Tensor]:
    """The loss's statistics: token means over the unmasked tokens ``m`` ``[N, T]`` (detached)."""
    n_tok = m.sum().clamp(min=1.0)
    return {
        "policy": policy,
        "kl": ((kl_tok if kl_tok is not None else torch.zeros_like(m)) * m).sum() / n_tok,
        "clip_frac": (clipped_taken.to(m.dtype).expand_as(m) * m).sum() / n_tok,
        "ratio_mean": (ratio.expand_as(m) * m).sum() / n_tok,
    }
