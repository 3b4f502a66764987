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


def credit_aggregates(dlogp: torch.Tensor, adv: torch.Tensor, segment: Sequence[str]) -> dict[str, float | None]:
    """The step's ``credit/*`` metrics from its recorded tokens, ``[M]`` each (every real completion token of the
    recorded rollouts): ``dlogp`` the change of each token's log-prob, ``adv`` the advantage the loss gave it (0 where
    masked), ``segment`` its segment.

    - ``{seg}_share``: the share of the total |dlogp| on each segment; ``{seg}_token_frac``: the share of the tokens;
    - ``sign_corr``: Pearson correlation of dlogp with sign(adv), over the tokens that carried loss;
    - ``half_mass_frac``: :func:`half_mass_fraction` of dlogp;
    - ``abs_mean``: mean |dlogp| per token; ``dlogp_pos``/``dlogp_neg``: mean dlogp over tokens with adv > 0 / < 0.
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
    out["tokens"] = int(dlogp.numel())
    return out
