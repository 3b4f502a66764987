"""The checks of the reward's signal: does a step's reward hold a contrast to learn from (no_signal), does it see
the answers (truncation, judge_failures, reward_blind), and is there any left (saturation)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from grpolab.doctor.rows import (
    CEILING,
    WINDOW,
    Finding,
    RunFacts,
    at_ceiling,
    learned,
    mean,
    span,
    steps_of,
    values,
    window,
)
from grpolab.probes.signals import series

NO_SIGNAL_SHARE = 0.75
"""Share of groups with equal rewards (reward/frac_zero_std) above which the update is mostly empty: at a pass rate
p a group of G is all equal with probability p^G + (1-p)^G, under 0.06 for p in [0.3, 0.7] and G = 8; 0.75 means
at most a quarter of the rollouts carry an advantage."""
CONSTANT_STD = 1e-6
"""A reward whose spread over every rollout of a step (reward/std) stays below this is constant: float rounding."""
RIGHT_SHARE = 0.5
"""With equal rewards in most groups, a mean first reward (reward/accuracy) at or above this says they are mostly
all right; below, mostly all wrong."""
CONTRAST_CHANCE = 0.5
"""The group size recommended for a no-signal run gives a group a contrast (reward variance) with at least this
probability at the run's pass rate: 1 - p^G - (1-p)^G >= 0.5."""
MAX_GROUP = 64
"""The largest group size the doctor recommends; past it, the data's difficulty is the thing to change."""
TRUNC_SHARE = 0.2
"""Share of completions stopped by --max-new-tokens (completion/truncated_frac) from which truncation is a warning:
one in five completions scored before it could answer."""
TRUNC_SEVERE = 0.8
"""Above this share, truncation is an error: most completions never reach an answer (TRL's old 256-token default cut
97-99% of reasoning completions)."""
TRUNC_GAP = 0.1
"""How much lower (in the first reward, for rewards in [0, 1]) the cut completions must score than the rest for a
share under TRUNC_SEVERE to be a warning: cut completions that score like the rest were cut after they went wrong
(a ramble on a short-answer task), and a longer limit would not raise the reward. Measured per step in training
(doctor/truncated_reward_gap), else from the logged rollouts; unknown: a warning."""
TRUNC_GAP_SHARE = 0.05
"""Under TRUNC_SHARE, from this share on, cut completions scoring TRUNC_GAP below the rest are reported as info."""
ERROR_SHARE = 0.5
"""Reward-function evaluations that raised or gave a non-finite value (reward/errors), as a share of all: above it
most rollouts are scored 0 for the function's fault, not the completion's."""
JUDGE_FAILED_SHARE = 0.05
"""An LLM judge's failed requests (reward/judge_failed_frac: endpoint errors past their retries, answers the parser
cannot read), as a share of its requests over WINDOW steps: from it on, enough rollouts score --judge-failure-score
instead of their worth to bend a group's advantages (one of a group of 8 at 0.05 on average: 1 in 3 groups)."""
JUDGE_FAILED_SEVERE = 0.5
"""... and at this share most rollouts are scored by the failures, not the completions: an error."""
FORMAT_FLOOR = 0.1
"""With the built-in answer check: a share of well-formed answers (reward/format) and of right ones
(reward/accuracy) both at or below this says the check almost never finds an answer to compare."""
RANK_FALL = 0.5
"""Saturation: the effective rank (probe/eff_rank) has gone this share of the way from its early value to 1, the
floor of any effective rank. On the last-letter runs of docs/foundations.md the rank's half-way fall came about 9
steps before the held-out accuracy saturated."""
RANK_POINTS = 2
"""Probes averaged for the rank's early and current values (each probe's mean over its groups)."""


def contrast_group_size(p: float, current: int) -> int | None:
    """The smallest power-of-two group size above ``current`` (at most MAX_GROUP) whose groups hold a contrast with
    probability CONTRAST_CHANCE at pass rate ``p``: 1 - p^G - (1-p)^G. None if none does."""
    g = 2 ** math.ceil(math.log2(max(current, 1) + 1))
    while g <= MAX_GROUP:
        if 1 - p**g - (1 - p) ** g >= CONTRAST_CHANCE:
            return g
        g *= 2
    return None


def no_signal(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """Most groups have equal rewards (all right, all wrong, or a constant reward): little or no advantage to learn
    from. A run whose reward rose before its groups ran out of contrast is saturation's case, not this one."""
    w = window(rows)
    zero = mean(w, "reward/frac_zero_std")
    fixed = constant_accuracy(w)
    if fixed is not None and not learned(rows):
        return _task_blind(w, fixed)
    if zero is None or zero < NO_SIGNAL_SHARE or learned(rows) or mean(w, "distill/kl") is not None:
        return None  # a --teacher's term moves every group, equal rewards or not
    p = mean(w, "reward/accuracy")
    p = 0.0 if p is None else min(max(p, 0.0), 1.0)
    evidence = f"reward/frac_zero_std {zero:.2f} over {steps_of(w)} (threshold {NO_SIGNAL_SHARE})"
    keys = ("reward/frac_zero_std", "reward/mean")
    if all(r.get("reward/std") is not None and r["reward/std"] < CONSTANT_STD for r in w):
        value = mean(w, "reward/mean")
        return Finding(
            "no_signal", "error", f"No signal: every completion gets the same reward, {value:.3g}",
            f"{evidence}; reward/std < {CONSTANT_STD:g} at every step",
            "check the reward function on a right and a wrong completion (a TRL-form function gets the columns it "
            "names as keyword lists); if it is right, every answer is wrong: easier data or --few-shot 2",
            keys, span(w), NO_SIGNAL_SHARE,
        )  # fmt: skip
    g = contrast_group_size(p, facts.group_size)
    bigger = (
        f"--group-size {g} (a group then holds a contrast with probability >= {CONTRAST_CHANCE:g} at pass rate {p:.2f})"
        if g
        else None
    )
    adaptive = "--sampling adaptive (draws more rollouts only for the groups with no contrast yet)"
    if p >= RIGHT_SHARE:
        title, data = "No signal: most groups are all right", "harder data (drop the prompts the policy always solves)"
    else:
        title, data = "No signal: most groups are all wrong", "easier data, --few-shot 2, or a supervised warm start"
    fixes = [f for f in (bigger, adaptive if facts.sampling != "adaptive" else None, data) if f]
    return Finding(
        "no_signal", "error", title, f"{evidence}; reward/accuracy {p:.2f}",
        "; or ".join(fixes), keys, span(w), NO_SIGNAL_SHARE,
    )  # fmt: skip


def constant_accuracy(w: Sequence[dict]) -> float | None:
    """0 or 1 when the first reward function (reward/accuracy) gave that same value to every rollout of every step of
    ``w`` (its mean is exactly 0 or 1: rewards in [0, 1]); None otherwise."""
    acc = [r.get("reward/accuracy") for r in w]
    if not w or any(a is None for a in acc) or len(set(acc)) != 1 or acc[0] not in (0, 1):
        return None
    return float(acc[0])


def _task_blind(w: Sequence[dict], value: float) -> Finding:
    """no_signal's finding for a first reward that is the same for every rollout (other terms may still vary)."""
    others = mean(w, "reward/std") or 0.0
    rest = (
        f"; the total reward still varies (reward/std {others:.3g}): the update learns the other terms (format), not "
        "the task"
        if others >= CONSTANT_STD
        else ""
    )
    if value == 1:
        title, fix = (
            "No signal: the first reward function gives every completion 1",
            "check the reward function on a wrong completion: it should score 0; if it does, the data is too easy "
            "(harder data)",
        )
    else:
        title, fix = (
            "No signal: the first reward function gives every completion 0",
            "check the reward function on a right completion; if it pays, every answer is wrong: easier data, "
            "--few-shot 2, or a supervised warm start",
        )
    return Finding(
        "no_signal", "error", title,
        f"reward/accuracy exactly {value:g} at every step of {steps_of(w)}{rest}",
        fix, ("reward/accuracy", "reward/frac_zero_std"), span(w),
    )  # fmt: skip


def truncation(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """Completions stopped by --max-new-tokens: an error when most are; a warning when TRUNC_SHARE are and they score
    TRUNC_GAP below the rest (or their scores are unknown); info when they score like the rest, or when fewer are cut
    but those score lower."""
    w = window(rows)
    share = mean(w, "completion/truncated_frac")
    if share is None or share < TRUNC_GAP_SHARE:
        return None
    gap = mean(w, "doctor/truncated_reward_gap")
    if gap is None:
        gap = truncated_gap([r for r in rollouts if r["step"] <= w[-1]["step"]], facts.max_new_tokens)
    if share >= TRUNC_SEVERE:
        severity = "error"
    elif share >= TRUNC_SHARE:
        severity = "warning" if gap is None or gap >= TRUNC_GAP else "info"
    elif gap is not None and gap >= TRUNC_GAP:
        severity = "info"
    else:
        return None
    length = recommended_length(facts.max_new_tokens, share)
    # under TRUNC_SHARE the share alone would not be reported: say so, beside the gap that is
    bar = f"threshold {TRUNC_SHARE}" if share >= TRUNC_SHARE else f"under the {TRUNC_SHARE} that alone is reported"
    evidence = (
        f"completion/truncated_frac {share:.2f} over {steps_of(w)} ({bar}; --max-new-tokens {facts.max_new_tokens})"
    )
    if gap is not None:
        evidence += f"; the cut completions score {gap:.2f} below the rest (threshold {TRUNC_GAP})"
    return Finding(
        "truncation", severity,
        f"Truncation: {100 * share:.0f}% of completions stop at --max-new-tokens {facts.max_new_tokens}",
        evidence,
        f"--max-new-tokens {length} (completions cut before their answer are scored as wrong; "
        "--mask-truncated leaves them out of the loss)",
        ("completion/truncated_frac", "doctor/truncated_reward_gap", "completion/len_mean"), span(w), TRUNC_SHARE,
    )  # fmt: skip


def recommended_length(max_new_tokens: int, share: float) -> int:
    """A power of two at least twice ``max_new_tokens`` (four times when at least TRUNC_SEVERE of completions are cut:
    their length is unknown beyond the limit)."""
    factor = 4 if share >= TRUNC_SEVERE else 2
    return 2 ** math.ceil(math.log2(max(max_new_tokens, 1) * factor))


def truncated_gap(rollouts: Sequence[dict], max_new_tokens: int) -> float | None:
    """From logged rollouts (their total reward): the mean reward of those that ended before ``max_new_tokens`` minus
    that of those cut by it (``tokens >= max_new_tokens``), over the last WINDOW logged steps; None unless both kinds
    are there."""
    steps = set(sorted({r["step"] for r in rollouts})[-WINDOW:])
    last = [r for r in rollouts if r["step"] in steps and "tokens" in r]
    cut = [r["reward"] for r in last if r["tokens"] >= max_new_tokens]
    rest = [r["reward"] for r in last if r["tokens"] < max_new_tokens]
    if not cut or not rest:
        return None
    return statistics.fmean(rest) - statistics.fmean(cut)


def judge_failures(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """An LLM judge (--judge) failing on a share of its requests: each failure scores --judge-failure-score, not the
    completion."""
    w = window(rows)
    share = mean(w, "reward/judge_failed_frac") if w else None
    if share is None or share < JUDGE_FAILED_SHARE:
        return None
    severe = share >= JUDGE_FAILED_SEVERE
    return Finding(
        "judge_failures", "error" if severe else "warning",
        f"The judge fails on {100 * share:.0f}% of its requests: those score --judge-failure-score, not the "
        "completion",
        f"reward/judge_failed_frac {share:.3f} over {steps_of(w)} (threshold "
        f"{JUDGE_FAILED_SEVERE if severe else JUDGE_FAILED_SHARE})",
        "an endpoint: check it is up and fast enough (the run's log names the last error; --judge-timeout, "
        "--judge-retries); answers that do not parse: make the template ask for exactly the form the judge's answer "
        "setting reads (yes/no, or one number on its range), or raise its max_tokens",
        ("reward/judge_failed_frac", "reward/mean"), span(w), JUDGE_FAILED_SEVERE if severe else JUDGE_FAILED_SHARE,
    )  # fmt: skip


def reward_blind(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """The reward never sees an answer: reward-function errors dominate, or the built-in answer check finds almost no
    well-formed answer."""
    w = window(rows)
    if not w:
        return None
    errors = sum(values(w, "reward/errors"))
    scored = sum(values(w, "sampling/rollouts")) * max(facts.reward_functions, 1)
    if scored and errors / scored >= ERROR_SHARE:
        return Finding(
            "reward_blind", "error",
            f"The reward never sees an answer: the reward function failed on {100 * errors / scored:.0f}% of "
            "rollouts",
            f"reward/errors {errors:.0f} of {scored:.0f} evaluations over {steps_of(w)} (threshold {ERROR_SHARE})",
            "fix the reward function's exception (the run's log names it at the first failure); a failed "
            "evaluation scores 0",
            ("reward/errors", "reward/mean"), span(w), ERROR_SHARE,
        )  # fmt: skip
    fmt, acc = mean(w, "reward/format"), mean(w, "reward/accuracy")
    if not facts.answer_check or fmt is None or fmt > FORMAT_FLOOR or (acc or 0.0) > FORMAT_FLOOR:
        return None
    want = "a \\boxed{...} answer" if facts.answer_check == "boxed" else "a final line '#### <number>'"
    return Finding(
        "reward_blind", "error",
        f"The reward never sees an answer: {100 * (1 - fmt):.0f}% of completions have no well-formed answer",
        f"reward/format {fmt:.2f} and reward/accuracy {acc or 0.0:.2f} over {steps_of(w)} (threshold {FORMAT_FLOOR})",
        f"make the prompt ask for {want} (--system-prompt, --few-shot 2), or give a --reward-fn that reads the "
        "answer in the form the model writes",
        ("reward/format", "reward/accuracy"), span(w), FORMAT_FLOOR,
    )  # fmt: skip


def saturation(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """The run has taken most of what this data gives: the effective rank has fallen RANK_FALL of the way to 1, or the
    reward sits near its ceiling, or the groups ran out of contrast after the reward rose."""
    w = window(rows)
    signs, keys, threshold = [], [], None
    rank = series(rows, "probe/eff_rank")
    if len(rank) >= 2 * RANK_POINTS:
        early = statistics.fmean(v for _, v in rank[:RANK_POINTS])
        now = statistics.fmean(v for _, v in rank[-RANK_POINTS:])
        threshold = 1 + (1 - RANK_FALL) * (early - 1)
        if early > 1 and now <= threshold:
            signs.append(
                f"probe/eff_rank {now:.2f} at steps {rank[-RANK_POINTS][0]}-{rank[-1][0]}, down from {early:.2f} at "
                f"steps {rank[0][0]}-{rank[RANK_POINTS - 1][0]} (threshold {threshold:.2f}: {RANK_FALL:g} of the way "
                "to 1)"
            )
            keys.append("probe/eff_rank")
    acc = mean(w, "reward/accuracy")
    if at_ceiling(acc, facts) and constant_accuracy(w) is None:
        signs.append(f"reward/accuracy {acc:.2f} over {steps_of(w)} (ceiling {CEILING})")
        keys.append("reward/accuracy")
    zero = mean(w, "reward/frac_zero_std")
    if zero is not None and zero >= NO_SIGNAL_SHARE and learned(rows):
        signs.append(f"reward/frac_zero_std {zero:.2f} after the reward rose (threshold {NO_SIGNAL_SHARE})")
        keys.append("reward/frac_zero_std")
    if not signs:
        return None
    return Finding(
        "saturation", "info", "Saturation: more steps on this data will buy little",
        "; ".join(signs),
        "evaluate now (grpolab eval --model RUN) and stop, or move to harder data; the effective rank's half-way fall "
        "came about 9 steps before the held-out accuracy saturated on the last-letter runs of docs/foundations.md",
        tuple(keys), span(w) if w else (rank[0][0], rank[-1][0]), threshold if keys[0] == "probe/eff_rank" else None,
    )  # fmt: skip
