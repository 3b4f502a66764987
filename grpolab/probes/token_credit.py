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

from grpolab.common.stats import mean_ci
from grpolab.data.answers import answer_spans

SEGMENTS = ("answer", "reasoning", "format")
CONTEXT = "context"
"""The segment of an episode's environment tokens: shown, never credited."""


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
    :func:`grpolab.data.answers.answer_spans`), ``format`` (its text lies in the format's markers, or it has none: an
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
    dlogp: torch.Tensor,
    adv: torch.Tensor,
    segment: Sequence[str],
    logp: torch.Tensor | None = None,
    turns: Sequence[int] | None = None,
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
      logit is 1 - pi(o_t), so a token the policy was sure of barely moves whatever its advantage;
    - ``turn{h}_share`` (with ``turns``, episodes): the share of |dlogp| on the replies of turn h (from 1).
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
    if turns is not None:
        t = torch.tensor(list(turns))
        for h in sorted(set(t.tolist())):
            out[f"turn{h + 1}_share"] = float(mag[t == h].sum()) / total if total > 0 else None
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


def record_aggregates(records: Sequence[dict]) -> dict[str, float | None]:
    """:func:`credit_aggregates` of token_credit.jsonl records (one step's), from their tokens: the policy's tokens
    only (an episode's environment tokens are ``context``), with each turn's share of |dlogp| for episodes."""
    keep = [(r, i) for r in records for i, seg in enumerate(r["segment"]) if seg != CONTEXT]

    def cat(key: str) -> torch.Tensor:
        return torch.tensor([math.nan if r[key][i] is None else r[key][i] for r, i in keep], dtype=torch.float64)

    turns = [r["turn"][i] for r, i in keep] if all("turn" in r for r in records) and records else None
    return credit_aggregates(cat("dlogp"), cat("adv"), [r["segment"][i] for r, i in keep], cat("logp"), turns)


def step_aggregates(records: Sequence[dict]) -> list[dict]:
    """:func:`record_aggregates` of each step's records (token_credit.jsonl lines), in step order:
    ``{"step": s, **aggregates}``."""
    by_step: dict[int, list[dict]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r)
    return [{"step": s, **record_aggregates(recs)} for s, recs in sorted(by_step.items())]


# ---------------------------------------------------------------------- a recorded rollout, token by token
def _floats(t: torch.Tensor | None, on: torch.Tensor | None = None) -> list | None:
    """JSON has no NaN: a value that is not a number (or not the policy's, ``on`` False) is null."""
    if t is None:
        return None
    values = t.double().tolist()
    keep = [True] * len(values) if on is None else on.tolist()
    return [v if k and math.isfinite(v) else None for v, k in zip(values, keep)]


def _turn_segments(spans: list[str], turns: list[int]) -> list[str]:
    """Each token's segment: :func:`token_segments` of each turn's reply on its own; ``context`` off the policy's
    tokens."""
    out = [CONTEXT] * len(spans)
    i = 0
    while i < len(spans):
        if turns[i] < 0:
            i += 1
            continue
        j = i
        while j < len(spans) and turns[j] == turns[i]:
            j += 1
        out[i:j] = token_segments(spans[i:j])
        i = j
    return out


def credit_row(tokenizer, rows, r: int, k: int, watched, after: torch.Tensor, context_prompt: bool = False) -> dict:
    """The per-token part of a token_credit.jsonl line for token row ``r`` of ``rows`` (a
    :class:`grpolab.rollout.rows.Rows`), the ``k``-th row the update watched (``watched``: its
    :class:`grpolab.training.update.WatchedTokens`; ``after`` ``[K, T']``: the log-probs after the update). An episode's
    environment tokens are context: segment ``context``, no values. ``context_prompt``: the row's prompt goes first,
    as context (an episode's later turn that starts a sequence of its own)."""
    T = int(rows.batch.completion_mask[r].sum())  # completions are right-padded: tokens 0..T-1 are real
    ids = rows.batch.completion_ids[r, :T].tolist()
    episode = rows.action is not None
    on = rows.action[r, :T].bool().cpu() if episode else None
    turns = rows.turn[r, :T].tolist() if episode else [0] * T
    spans = token_spans(lambda i: tokenizer.decode(i, skip_special_tokens=True), ids)  # as Policy.decode
    before = watched.logp[k, :T].cpu()
    out = {
        "completion": "".join(spans),
        "tokens": spans,
        "ids": ids,
        "segment": _turn_segments(spans, turns) if episode else token_segments(spans),
        "dlogp": _floats(after[k, :T].cpu() - before, on),
        "logp": _floats(before, on),
        "logp_sampler": None if rows.logprobs is None else _floats(rows.logprobs[r, :T], on),
        "entropy": None if rows.entropy is None else _floats(rows.entropy[r, :T], on),
        "adv": _floats(watched.adv[k, :T].cpu(), on),
        "ratio": _floats(watched.ratio[k, :T].cpu(), on),
        "clipped": watched.clipped[k, :T].tolist(),
    }
    if getattr(watched, "teacher", None) is not None:  # a --teacher's per-token term beside the advantage
        out["teacher"] = _floats(watched.teacher[k, :T].cpu(), on)
    if episode:
        out["turn"] = [t if o else -1 for t, o in zip(turns, on.tolist())]
    if context_prompt:
        out = join_credit_rows([_context_tokens(tokenizer, rows.batch, r, out), out])
    return out


def _context_tokens(tokenizer, batch, r: int, like: dict) -> dict:
    """Row ``r``'s prompt as a record part of context tokens (the keys of ``like``)."""
    ids = batch.prompt_ids[r][batch.prompt_mask[r].bool()].tolist()
    spans = token_spans(lambda i: tokenizer.decode(i, skip_special_tokens=True), ids)
    n = len(ids)
    none = [None] * n
    part = {"completion": "".join(spans), "tokens": spans, "ids": ids, "segment": [CONTEXT] * n, "clipped": [False] * n}
    for key in (
        "dlogp",
        "logp",
        "logp_sampler",
        "entropy",
        "adv",
        "ratio",
        *(["teacher"] if "teacher" in like else []),
    ):
        part[key] = None if like[key] is None else list(none)
    if "turn" in like:
        part["turn"] = [-1] * n
    return part


def join_credit_rows(parts: list[dict]) -> dict:
    """One record of several (an episode's token rows, in order): texts joined, per-token lists concatenated."""
    if len(parts) == 1:
        return parts[0]
    out = {"completion": "".join(p["completion"] for p in parts)}
    for key in parts[0]:
        if key == "completion":
            continue
        out[key] = None if any(p[key] is None for p in parts) else [v for p in parts for v in p[key]]
    return out


def summarise_credit(per_step: Sequence[dict], parts: int = 4) -> list[dict]:
    """Per-step aggregates (:func:`step_aggregates`) in ``parts`` consecutive spans of steps: per span and key, the
    mean over its steps and a normal 95% interval of that mean, ``(mean, lo, hi)``.

    The interval treats the steps as independent draws: each step records other rollouts, so it covers which
    rollouts were recorded, not the variation between runs (seeds)."""
    steps = [r for r in per_step if r.get("tokens")]
    keys = [*SUMMARY_KEYS, *turn_share_keys(steps)]  # an episode's turns, when the records have them
    out = []
    size = max(1, math.ceil(len(steps) / parts))
    for i in range(0, len(steps), size):
        span = steps[i : i + size]
        entry: dict = {"first": span[0]["step"], "last": span[-1]["step"], "steps": len(span)}
        for key in keys:
            entry[key] = _mean_interval([r[key] for r in span if r.get(key) is not None])
        out.append(entry)
    return out


def turn_share_keys(rows: Sequence[dict]) -> list[str]:
    """The ``turn{h}_share`` keys that occur in ``rows``, in turn order."""
    found = {k for r in rows for k in r if k.startswith("turn") and k.endswith("_share")}
    return sorted(found, key=lambda k: int(k[4:-6]))


def _mean_interval(values: list[float]) -> tuple[float, float, float] | None:
    """(mean, lo, hi): :func:`grpolab.common.stats.mean_ci` (None with no values; lo = hi = mean with one, a span of one
    step)."""
    if not values:
        return None
    if len(values) < 2:
        return values[0], values[0], values[0]
    return mean_ci(values)
