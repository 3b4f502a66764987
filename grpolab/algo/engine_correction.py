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

Top-p, top-k, min-p and the repetition penalty. An engine that samples with them reports the log-prob of the
distribution it sampled from, p_s: for top-p, renormalised over the nucleus, log(p_engine / S_engine), S the
nucleus's mass. The trainer's log-prob is over the whole vocabulary at the temperature, so their difference carries
the offset log p_T(o_t) - log p_s(o_t) on every token: for top-p alone log S, and the ratio would be the kept mass
(0.9 at top-p 0.9), not a mismatch (the trap TRL's issue 6789 describes). The update therefore puts the engine's
log-prob back on the whole vocabulary first, adding the offset the trainer computes from its own logits at that
position with the same definition of the sampling distribution (:func:`on_full_support`;
``grpolab.models.sampling_rules``, vLLM's order: penalty, temperature, min-p, top-k, top-p). The offset is

    (z_o - z'_o) / T + logsumexp_kept(z' / T) - logsumexp(z / T),

z the trainer's logits, z' the same after the repetition penalty (the tokens seen in the prompt and the completion
before t), kept the tokens min-p, top-k and top-p keep: for top-p alone log S_trainer; for top-k and min-p the log of
the mass they keep; the penalty adds its change of the token's own logit and moves the normaliser. Then
r_t = p_s,trainer(o_t) / p_s,engine(o_t): the ratio of the two *sampling* distributions at the sampled token, which
is 1 for an engine that computes what the trainer computes, under any of the rules; what remains is the engine's
numerics (another kernel, another precision). The rules themselves are part of how rollouts are drawn and are not
reweighted (no engine samples outside what they keep, so no weight could restore those tokens).

:func:`mismatch_sums` and :func:`mismatch_metrics` measure the mismatch on every step (``engine/*``), in the forms
peers report it: the share of tokens whose ratio leaves [0.9, 1.1], the ratio's and the log-ratio's spread, and the
sequence-level log-ratio log R.
"""

from __future__ import annotations

import torch

from grpolab.algo.names import CORRECTIONS  # noqa: F401 - re-exported

AUTO = "sequence-truncate"
"""What ``--engine-correction auto`` uses where the sampler is not exact (see :func:`resolve_correction`): of the four
modes, the one whose step gradient came closest to the exact importance-weighted gradient of the same bf16 rollouts
on SmolLM2 (relative error 0.003 and 0.009 at the starting weights and after 20 steps, against 0.17-0.22 for
token-truncate and 0.19-0.49 for none; 16-token completions, docs/precision.md). With 16 tokens the sequence
ratio rarely reaches the cap, so the mode is the exact weighting; its cap binds more as completions grow."""


def resolve_correction(choice: str, exact_engine: bool, loss_type: str = "clip") -> str:
    """The mode ``--engine-correction choice`` means for a run: ``auto`` is none where the engine computes what the
    trainer computes (``exact_engine``: grpolab's sampler in the trainer's dtype, whose log-probs differ from the
    trainer's by rounding alone), and :data:`AUTO` elsewhere (another dtype, or vLLM's kernels); none under vespo,
    which takes no correction. Any other choice is itself."""
    if choice != "auto":
        return choice
    return "none" if exact_engine or loss_type == "vespo" else AUTO


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


BAND = (0.9, 1.1)
"""The ratio band whose leavers ``engine/ratio_outside_frac`` counts (the band TRL's issue 6789 reports: 7.5% of
Qwen2.5-0.5B's tokens outside it under vLLM)."""

SUM_KEYS = ("tok", "abs", "d", "d2", "r", "r2", "out", "seq", "s", "s2")
"""What :func:`mismatch_sums` adds up (over passes and ranks): tokens; sum |log r|; sum log r; sum (log r)^2; sum r;
sum r^2; tokens outside :data:`BAND`; sequences; sum log R; sum (log R)^2."""
MAX_KEYS = ("abs_max", "seq_abs_max")
"""What :func:`mismatch_sums` takes the maximum of: max |log r| over tokens, max |log R| over sequences."""


def on_full_support(engine_logp: torch.Tensor, trainer_offset: torch.Tensor) -> torch.Tensor:
    """An engine's log-probs of the distribution it sampled from (after top-p, top-k, min-p and the repetition
    penalty) put on the whole vocabulary with the trainer's offset log p_T - log p_sampling at each position (top-p
    alone: its log nucleus mass): ``[N, T]`` + ``[N, T]`` (see the module docstring; an offset of 0, every rule off,
    changes nothing)."""
    return engine_logp + trainer_offset.to(engine_logp.dtype)


def mismatch_sums(trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The sums (:data:`SUM_KEYS`) and maxima (:data:`MAX_KEYS`) over the tokens of ``mask`` ``[N, T]``, and over its
    rows with any token, from which :func:`mismatch_metrics` makes the step's ``engine/*`` statistics. Log-probs
    ``[N, T]``; log r = trainer - engine per token, log R its sum over a row's tokens. In float64."""
    m = mask.bool()
    d = (trainer_logp - engine_logp).detach().double() * m  # [N, T] log r, 0 off the mask
    tok = d[m]  # [M]
    r = tok.exp()
    rows = m.any(dim=1)
    seq = d.sum(dim=1)[rows]  # [rows] log R
    lo, hi = BAND
    return {
        "tok": float(tok.numel()), "abs": float(tok.abs().sum()), "d": float(tok.sum()), "d2": float((tok**2).sum()),
        "r": float(r.sum()), "r2": float((r**2).sum()), "out": float(((r < lo) | (r > hi)).sum()),
        "seq": float(seq.numel()), "s": float(seq.sum()), "s2": float((seq**2).sum()),
        "abs_max": float(tok.abs().max()) if tok.numel() else 0.0,
        "seq_abs_max": float(seq.abs().max()) if seq.numel() else 0.0,
    }  # fmt: skip


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """``engine/*`` from the step's :func:`mismatch_sums` added over passes and ranks (maxima: their maximum); empty
    when no token was compared. Means and (population) standard deviations over tokens and over sequences."""
    n, k = sums["tok"], sums["seq"]
    if not n:
        return {}

    def std(total: float, squares: float, count: float) -> float:
        return max(squares / count - (total / count) ** 2, 0.0) ** 0.5

    return {
        "engine/logprob_diff_mean": sums["abs"] / n,
        "engine/logprob_diff_max": sums["abs_max"],
        "engine/logratio_mean": sums["d"] / n,
        "engine/logratio_std": std(sums["d"], sums["d2"], n),
        "engine/ratio_std": std(sums["r"], sums["r2"], n),
        "engine/ratio_outside_frac": sums["out"] / n,
        "engine/seq_logratio_mean": sums["s"] / k,
        "engine/seq_logratio_std": std(sums["s"], sums["s2"], k),
        "engine/seq_logratio_max": sums["seq_abs_max"],
    }
