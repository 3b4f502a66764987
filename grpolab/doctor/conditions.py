"""The conditions that keep a GRPO run from learning, each a pure function of the run's metric rows.

Each check takes the rows logged so far (``metrics.jsonl``'s, oldest first), the few options of the run it needs
(:class:`RunFacts`) and, when the run logged them, its rollouts (``rollouts.jsonl``'s records); it returns a
:class:`Finding` or None. A check looks at the last :data:`WINDOW` training steps unless it says otherwise, so what
it reports is the run's state, not one noisy step. Every threshold is a named constant with the reason for its value.

Severities: ``error``, the run cannot learn as it is set up; ``warning``, it learns less or wrongly; ``info``, a
fact worth acting on that is not a fault (a saturated run has done its work). :func:`diagnose` runs every check and
orders the findings most serious first and, within a severity, causes before their symptoms (a truncation before
the equal rewards it causes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from grpolab.doctor.distill import teacher_agrees, teacher_fights_reward
from grpolab.doctor.optimisation import big_step, entropy, no_movement, not_learning, rounding, sampler_mismatch
from grpolab.doctor.rows import LEVEL, SEVERITIES, Finding, RunFacts
from grpolab.doctor.signal import judge_failures, no_signal, reward_blind, saturation, truncation
from grpolab.doctor.task import eval_drop, reward_hacking

__all__ = ["CHECKS", "EXPLAINS", "LEVEL", "NAMES", "ONLY_WITH", "Finding", "RunFacts", "diagnose", "explained", "order"]


CHECKS: tuple[Callable[..., Finding | None], ...] = (
    rounding,
    big_step,
    entropy,
    reward_hacking,
    truncation,
    judge_failures,
    reward_blind,
    sampler_mismatch,
    no_movement,
    no_signal,
    eval_drop,
    saturation,
    teacher_fights_reward,
    teacher_agrees,
    not_learning,
)
"""Every check, causes before their symptoms (an order in which each comes before what it EXPLAINS): the order of
findings of one severity."""
NAMES = tuple(c.__name__ for c in CHECKS)
ONLY_WITH = {"teacher_agrees": "distill/kl", "teacher_fights_reward": "distill/kl"}
"""Checks whose level a run logs only when it logs this metric (a run without a teacher has no teacher_agrees)."""

EXPLAINS = {
    "rounding": {"no_movement", "not_learning"},
    "big_step": {"truncation", "reward_blind", "entropy", "no_signal", "eval_drop", "reward_hacking", "not_learning"},
    "entropy": {"truncation", "reward_blind", "no_signal", "eval_drop", "not_learning"},
    "reward_hacking": {"truncation", "eval_drop"},
    "truncation": {"reward_blind", "no_signal"},
    "judge_failures": {"reward_blind", "no_signal", "not_learning"},
    "reward_blind": {"no_signal"},
    "no_movement": {"not_learning"},
    "sampler_mismatch": {"not_learning"},
}
"""Conditions that cause others: an update the weights' precision rounds away leaves the policy standing, an
overshooting step breaks the policy's answers (cut, malformed, all wrong), a
reward that pays for length runs completions into the limit, a cut completion has no answer to check, a reward that
finds no answer gives every rollout the same 0. A cause found no later than its effect is listed with the effect's
severity (the cause of an error is one), before it."""


def order(findings: Sequence[Finding]) -> list[Finding]:
    """Most serious first: by severity, a cause taking the gravest severity among the findings it explains (found at
    the same check or later), then causes before symptoms (CHECKS' order)."""
    by_name = {f.name: f for f in findings}

    def rank(f: Finding) -> int:
        effects = [
            by_name[n]
            for n in EXPLAINS.get(f.name, ())
            if n in by_name and (f.first_step or 0) <= (by_name[n].first_step or 0)
        ]
        return min(SEVERITIES.index(g.severity) for g in [f, *effects])

    return sorted(findings, key=lambda f: (rank(f), NAMES.index(f.name)))


def explained(f: Finding, findings: Sequence[Finding]) -> list[str]:
    """The findings ``f`` explains (see EXPLAINS)."""
    return [
        g.name for g in findings
        if g.name in EXPLAINS.get(f.name, ()) and (f.first_step or 0) <= (g.first_step or 0)
    ]  # fmt: skip


def diagnose(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> list[Finding]:
    """Every condition the rows show, most serious first (:func:`order`)."""
    return order([f for check in CHECKS if (f := check(rows, facts, rollouts)) is not None])
