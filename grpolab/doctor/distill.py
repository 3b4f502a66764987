"""The checks of a run that distills from a teacher (--teacher): is there anything left for the teacher to teach."""

from __future__ import annotations

from collections.abc import Sequence

from grpolab.doctor.rows import Finding, RunFacts, mean, span, steps_of, window

AGREES_KL = 0.001
"""Nats per token of the teacher's KL from the policy (distill/kl) under which the teacher agrees with the student:
about 0.05 nats over a 48-token completion, a per-token term a thousandth of a reward's advantage. Measured: the
built-in model distilling from its GRPO-trained self still gained held-out accuracy at 0.008 (docs/distillation.md)."""


def teacher_agrees(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """The teacher's distribution and the policy's are the same on the policy's samples: distillation has nothing
    left to teach (a teacher no better than the student, or a student that has caught up)."""
    w = window(rows)
    kl = mean(w, "distill/kl")
    if kl is None or kl >= AGREES_KL:
        return None
    return Finding(
        "teacher_agrees", "info", "The teacher agrees with the student: its signal is spent",
        f"distill/kl {kl:.4f} nats a token over {steps_of(w)} (threshold {AGREES_KL})",
        "a stronger --teacher (a later checkpoint, a larger model), or go on without one (the task reward alone)",
        ("distill/kl",), span(w), AGREES_KL,
    )  # fmt: skip
