"""The doctor's check of a distilling run: a teacher that agrees with the student."""

from __future__ import annotations

from grpolab.doctor.distill import AGREES_KL, FIGHT_CORR, teacher_agrees, teacher_fights_reward
from grpolab.doctor.rows import RunFacts
from grpolab.doctor.signal import no_signal


def _rows(kl: float | None, zero_std: float = 0.0) -> list[dict]:
    rows = [{"step": s, "reward/mean": 0.3, "reward/accuracy": 0.3, "reward/std": 0.4,
             "reward/frac_zero_std": zero_std} for s in range(1, 21)]  # fmt: skip
    if kl is not None:
        for r in rows:
            r["distill/kl"] = kl
    return rows


def test_teacher_agrees_fires_below_its_threshold_only_with_a_teacher():
    facts = RunFacts()
    found = teacher_agrees(_rows(AGREES_KL / 2), facts)
    assert found is not None and found.name == "teacher_agrees" and "distill/kl" in found.evidence
    assert teacher_agrees(_rows(AGREES_KL * 2), facts) is None
    assert teacher_agrees(_rows(None), facts) is None


def test_groups_of_equal_rewards_are_no_missing_signal_with_a_teacher():
    facts = RunFacts()
    assert no_signal(_rows(None, zero_std=0.9), facts) is not None
    assert no_signal(_rows(0.2, zero_std=0.9), facts) is None


def test_teacher_fights_reward_fires_on_a_negative_correlation_only():
    facts = RunFacts()
    rows = _rows(0.2)
    for r in rows:
        r["distill/reward_corr"] = FIGHT_CORR - 0.1
    found = teacher_fights_reward(rows, facts)
    assert found is not None and found.severity == "warning" and "distill/reward_corr" in found.evidence
    for r in rows:
        r["distill/reward_corr"] = 0.05
    assert teacher_fights_reward(rows, facts) is None
    assert teacher_fights_reward(_rows(0.2), facts) is None  # no task reward: not measured
