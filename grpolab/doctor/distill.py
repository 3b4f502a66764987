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


FIGHT_CORR = -0.2
"""distill/reward_corr (the correlation over loss tokens of the rollout's advantage and the teacher's term) under
which the teacher fights the reward: the tokens the reward pays for are the ones the teacher would have the policy
leave, a fifth of the two terms' spread running against each other. A token-space reading of the cosine of the two
gradient parts, which benchmarks/distillation/rollout_signal.py measures exactly at a checkpoint (0.07 for the
built-in pair of docs/distillation.md, which do not fight); not calibrated on a pair that does."""


def teacher_fights_reward(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = ()) -> Finding | None:
    """With the task reward and rkl-reward, the teacher's per-token term runs against the rollouts' advantages: the
    two halves of the update cancel."""
    w = window(rows)
    corr = mean(w, "distill/reward_corr")
    if corr is None or corr >= FIGHT_CORR:
        return None
    return Finding(
        "teacher_fights_reward", "warning", "The teacher fights the reward: its term runs against the advantages",
        f"distill/reward_corr {corr:+.2f} over {steps_of(w)} (threshold {FIGHT_CORR})",
        "a teacher trained on this reward; or a smaller --distill-coef; or --no-task-reward to follow the teacher alone",
        ("distill/reward_corr", "distill/kl"), span(w), FIGHT_CORR,
    )  # fmt: skip
