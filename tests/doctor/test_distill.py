"""The doctor's check of a distilling run: a teacher that agrees with the student."""

from __future__ import annotations

from grpolab.doctor.distill import AGREES_KL, teacher_agrees
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
