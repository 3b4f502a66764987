"""Where an update's credit lands, token by token: the math of ``--log-token-credit K``.

GRPO gives every token of a rollout the same advantage [Foundations, Thm 3.1]; what an update
then does to each token's probability is not uniform. For a few rollouts per step the trainer
records, per token, the advantage the loss gave it and the change of its log-prob that the
step's update caused, ``dlogp_t = log pi_after(o_t) - log pi_before(o_t)``. This module holds
the pure parts: which rollouts to record, the text span and the segment (answer, reasoning,
format) of each token, and the step's aggregates (``credit/*``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from grpolab.answers import answer_spans
from grpolab.stats import mean_ci

SEGMENTS = ("answer", "reasoning", "format")


def pick_rollouts(adv: torch.Tensor, sizes: Sequence[int], k: int) -> list[int]:
    """The ``k`` rows to record: group by group, the first rollout with a positive advantage and the first with a
    negative one (rollouts are in sampling order, so within a sign this is a draw at random), then, if fewer than
    ``k`` were found, the remaining rows in order. ``adv`` ``[n]``; ``sizes``: the groups' sizes, rows contiguous."""
    chosen: list[int] = []
    start = 0
    for size in sizes:
        group = adv[start : start + size].tolist()
        for sign in (1, -1):
            first = next((start + g for g, a in enumerate(group) if a * sign > 0), None)
            if first is not None and len(chosen) < k:
                chosen.append(first)
        start += size
    rest = [r for r in range(int(adv.shape[0])) if r not in chosen]
    return chosen + rest[: max(0, k - len(chosen))]


def token_spans(decode: Callable[[list[int]], str], ids: Sequence[int]) -> list[str]:
    """The text each token adds to ``decode(ids)``: spans whose concatenation is exactly ``decode(ids)``.

    A token's span is what decoding the prefix through it adds to decoding the prefix before it. Byte-level
    tokenizers can split one character over several tokens (the prefix then ends in U+FFFD), and some decoders
    rewrite a prefix as it grows (a leading space dropped, spaces cleaned up): such a token gets the empty span and
    the next token that leaves a clean, extending prefix takes the text. Written by hand: tokenizers give offsets
    into the input text when encoding, not into the decoded text of sampled ids. Special tokens decode to ``""``.
    """
    spans: list[str] = []
    done = ""  # decode of the prefix up to the last token that took text
    for i in range(len(ids)):
        text = decode(list(ids[: i + 1]))
        if text.startswith(done) and not text.endswith("\ufffd"):
            spans.append(text[len(done) :])
            done = text
        else:
            spans.append("")
    full = decode(list(ids))
    if full != done:  # the decoder's last word differs from every prefix's: the rest goes to the last token
        if not full.startswith(done):
            return [""] * (len(ids) - 1) + [full] if ids else []
        spans[-1] += full[len(done) :]
    return spans


def token_segments(spans: Sequence[str]) -> list[str]:
    """Each token's segment of the completion ``"".join(spans)``: ``answer`` (it touches the final answer,
    :func:`grpolab.answers.answer_spans`), ``format`` (its text lies in the format's markers, or it has none: an
    end-of-sequence token) or ``reasoning`` (the rest)."""
    text = "".join(spans)
    answer, markers = answer_spans(text)
    out, pos = [], 0
    for span in spans:
        start, end = pos, pos + len(span)
        pos = end
        if start == end:
            out.append("format")
        elif answer is not None and start < answer[1] and answer[0] < end:
            out.append("answer")
        elif all(any(a <= c < b for a, b in markers) for c in range(start, end)):
            out.append("format")
        else:
            out.append("reasoning")
    return out


def half_mass_fraction(values: torch.Tensor) -> float | None:
    """The smallest fraction of the entries of ``values`` ``[M]`` whose absolute values hold half of the total
    (None when it is 0): small means the change is concentrated on few tokens."""
    mag = values.abs().double().sort(descending=True).values  # [M]
    total = float(mag.sum())
    if mag.numel() == 0 or total == 0.0:
        return None
    needed = int(torch.searchsorted(mag.cumsum(0), torch.tensor(0.5 * total, dtype=torch.float64)))
    return (needed + 1) / mag.numel()


def pearson(x: torch.Tensor, y: torch.Tensor) -> float | None:
    """Pearson correlation of two ``[M]`` tensors (None when either is constant or M < 2)."""
    if x.numel() < 2:
        return None
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = math.sqrt(float(x.pow(2).sum()) * float(y.pow(2).sum()))
    return float((x * y).sum()) / denom if denom > 0 else None


LOW_P = 0.9
"""A token the policy gave less than this probability before the update counts as one it was unsure of."""


def credit_aggregates(
    dlogp: torch.Tensor, adv: torch.Tensor, segment: Sequence[str], logp: torch.Tensor | None = None
) -> dict[str, float | None]:
    """The step's ``credit/*`` metrics from its recorded tokens, ``[M]`` each (every real completion token of the
    recorded rollouts): ``dlogp`` the change of each token's log-prob, ``adv`` the advantage the loss gave it (0 where
    masked), ``segment`` its segment, ``logp`` its log-prob before the update.

    - ``{seg}_share``: the share of the total |dlogp| on each segment; ``{seg}_token_frac``: the share of the tokens;
    - ``sign_corr``: Pearson correlation of dlogp with sign(adv), over the tokens that carried loss;
    - ``half_mass_frac``: :func:`half_mass_fraction` of dlogp;
    - ``abs_mean``: mean |dlogp| per token; ``dlogp_pos``/``dlogp_neg``: mean dlogp over tokens with adv > 0 / < 0;
    - ``low_p_share``, ``low_p_token_frac`` (with ``logp``): the share of |dlogp| on, and the share of, the tokens the
      policy gave less than :data:`LOW_P` before the update. The gradient of log pi(o_t) with respect to its own
      logit is 1 - pi(o_t), so a token the policy was sure of barely moves whatever its advantage.
    """
    dlogp, adv = dlogp.double(), adv.double()
    mag = dlogp.abs()
    total = float(mag.sum())
    out: dict[str, float | None] = {}
    for seg in SEGMENTS:
        on = torch.tensor([s == seg for s in segment], dtype=torch.bool)
        out[f"{seg}_share"] = float(mag[on].sum()) / total if total > 0 else None
        out[f"{seg}_token_frac"] = float(on.double().mean()) if len(segment) else None
    carried = adv != 0
    out["sign_corr"] = pearson(dlogp[carried], adv[carried].sign())
    out["half_mass_frac"] = half_mass_fraction(dlogp)
    out["abs_mean"] = float(mag.mean()) if mag.numel() else None
    out["dlogp_pos"] = float(dlogp[adv > 0].mean()) if bool((adv > 0).any()) else None
    out["dlogp_neg"] = float(dlogp[adv < 0].mean()) if bool((adv < 0).any()) else None
    if logp is not None:
        low = logp.double() < math.log(LOW_P)
        out["low_p_share"] = float(mag[low].sum()) / total if total > 0 else None
        out["low_p_token_frac"] = float(low.double().mean()) if low.numel() else None
    out["tokens"] = int(dlogp.numel())
    return out


SUMMARY_KEYS = (
    "answer_share",
    "answer_token_frac",
    "reasoning_share",
    "reasoning_token_frac",
    "format_share",
    "format_token_frac",
    "sign_corr",
    "half_mass_frac",
    "low_p_share",
    "low_p_token_frac",
    "abs_mean",
)


def step_aggregates(records: Sequence[dict]) -> list[dict]:
    """:func:`credit_aggregates` of each step's records (token_credit.jsonl lines), recomputed from the tokens, in
    step order: ``{"step": s, **aggregates}``."""
    by_step: dict[int, list[dict]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r)

    def cat(recs: list[dict], key: str) -> torch.Tensor:
        return torch.tensor([math.nan if v is None else v for r in recs for v in r[key]], dtype=torch.float64)

    return [
        {
            "step": s,
            **credit_aggregates(
                cat(recs, "dlogp"), cat(recs, "adv"), [x for r in recs for x in r["segment"]], cat(recs, "logp")
            ),
        }
        for s, recs in sorted(by_step.items())
    ]


def summarise_credit(per_step: Sequence[dict], parts: int = 4) -> list[dict]:
    """Per-step aggregates (:func:`step_aggregates`) in ``parts`` consecutive spans of steps: per span and key, the
    mean over its steps and a normal 95% interval of that mean, ``(mean, lo, hi)``.

    The interval treats the steps as independent draws: each step records other rollouts, so it covers which
    rollouts were recorded, not the variation between runs (seeds)."""
    steps = [r for r in per_step if r.get("tokens")]
    out = []
    size = max(1, math.ceil(len(steps) / parts))
    for i in range(0, len(steps), size):
        span = steps[i : i + size]
        entry: dict = {"first": span[0]["step"], "last": span[-1]["step"], "steps": len(span)}
        for key in SUMMARY_KEYS:
            entry[key] = _mean_interval([r[key] for r in span if r.get(key) is not None])
        out.append(entry)
    return out


def _mean_interval(values: list[float]) -> tuple[float, float, float] | None:
    """(mean, lo, hi): :func:`grpolab.stats.mean_ci` (None with no values; lo = hi = mean with one, a span of one
    step)."""
    if not values:
        return None
    if len(values) < 2:
        return values[0], values[0], values[0]
    return mean_ci(values)
