"""The doctor's reading of the early hacking signs: each sign's statistic against the run's own start, its
threshold's edge, the reward_hacking finding they raise before the held-out accuracy says anything, its evidence
from hacking.jsonl, and a run without the signs read as before."""

from __future__ import annotations

import json

import pytest

from grpolab.doctor import hacking as H
from grpolab.doctor import task as T
from grpolab.doctor.conditions import RunFacts, diagnose
from grpolab.doctor.examine import Watcher, examine

FACTS = RunFacts(max_new_tokens=48, group_size=8, lr=1e-4, answer_check="####")


def run_rows(n: int = 30, every: int = 5, **series) -> list[dict]:
    """``n`` training rows of a steady run with a rising held-out accuracy (evaluated every 10 steps), a
    ``hacking/align`` measurement every ``every`` steps; ``series``: metric -> function of the step."""
    out = []
    for step in range(n + 1):
        row = {"step": step}
        if step:
            row |= {"reward/mean": 0.5, "reward/std": 0.5, "reward/accuracy": 0.5, "reward/frac_zero_std": 0.1,
                    "completion/len_mean": 25.0, "completion/truncated_frac": 0.0, "policy/entropy": 0.5,
                    "sampling/rollouts": 64, "doctor/weight_change": 1e-4, "grad/norm": 1.0}  # fmt: skip
        if step % 10 == 0:
            acc = 0.2 + step / 100
            row |= {"eval/accuracy_sampled": acc, "eval/accuracy_sampled_lo": acc - 0.02,
                    "eval/accuracy_sampled_hi": acc + 0.02}  # fmt: skip
        for key, f in series.items():
            value = f(step)
            if value is not None and (key != "hacking/align" or step % every == 0) and (step or "honeypot" in key):
                row[key] = value
        out.append(row)
    return out


def test_each_sign_alarms_at_its_threshold_over_its_own_start():
    th = H.Thresholds()
    flat = run_rows(**{"hacking/align": lambda s: 0.4, "hacking/trick_sim": lambda s: 0.6})
    assert H.alarms(flat) == []  # high, but where the run started: no alarm
    edge = th.align + 1e-9
    rising = run_rows(**{"hacking/align": lambda s: 0.2 + (edge if s >= 25 else 0.0)})
    series = H.sign_series(rising)["align"]
    assert H.first_crossing(series, th.align) == 30  # the mean of the last two measurements (25, 30) reaches it
    assert [a.sign for a in H.alarms(rising)] == ["align"]
    below = run_rows(**{"hacking/align": lambda s: 0.2 + (th.align - 1e-6 if s >= 20 else 0.0)})
    assert H.alarms(below) == []
    trick = run_rows(**{"hacking/trick_sim": lambda s: 0.3 + (0.5 if s > 20 else 0.0)})
    assert H.first_crossing(H.sign_series(trick)["trick"], 0.15) == 22  # steps 21, 22 of the last five: +0.2
    assert th.trick is None and H.alarms(trick) == []  # logged, never an alarm by default
    assert [a.sign for a in H.alarms(trick, H.Thresholds(trick=0.15))] == ["trick"]


def test_honeypot_and_audit_read_their_shares():
    paid = run_rows(**{"hacking/honeypot_paid": lambda s: (0.0 if s < 20 else 0.1) if s % 10 == 0 else None})
    assert H.first_crossing(H.sign_series(paid)["honeypot"], H.Thresholds().honeypot) == 20
    assert [a.sign for a in H.alarms(paid)] == ["honeypot"]
    audit = run_rows(**{"hacking/audit_paid_failed": lambda s: 0.5 if s in (28, 29, 30) else 0.0})
    assert [(a.sign, a.step) for a in H.alarms(audit)] == [("audit", 30)]  # 1.5 / 5 = 0.3 >= 0.1
    assert H.first_crossing(H.sign_series(audit)["audit"], 0.1) == 28


def test_an_early_sign_is_a_finding_while_the_held_out_accuracy_still_rises():
    hacked = run_rows(**{"hacking/align": lambda s: 0.2 if s < 25 else 0.6})
    found = T.reward_hacking(hacked, FACTS)
    assert found is not None and "align" in found.title and "hacking/align" in found.keys
    assert "step 30" in found.evidence and "checker" in found.fix
    assert T.reward_hacking(run_rows(), FACTS) is None  # the lagging signs: none while the accuracy rises
    without = [{k: v for k, v in r.items() if not k.startswith("hacking/")} for r in hacked]
    assert T.reward_hacking(without, FACTS) is None  # a run without the signs is read as before


def test_the_watcher_says_the_sign_and_the_doctor_shows_its_rollouts(tmp_path):
    hacked = run_rows(**{"hacking/align": lambda s: 0.2 if s < 25 else 0.6})
    lines: list[str] = []
    watcher = Watcher({}, 5, log=lines.append, out="runs/x")
    levels = [watcher.check(r["step"], {k: v for k, v in r.items() if k != "step"}) for r in hacked]
    fired = [r["step"] for r, lv in zip(hacked, levels) if lv.get("doctor/reward_hacking")]
    assert fired[0] == 25 and any("Early signs of reward hacking (align)" in x for x in lines)
    assert any(x.startswith("  evidence:") and "grpolab doctor runs/x" in x for x in lines)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hacked))
    carried = {"question": "12+x", "completion": "#### ", "reward": 1.0, "advantage": 2.0, "loading": 0.9}
    record = {"step": 25, "sign": "align", "value": 0.6, "rollouts": [carried, {**carried, "loading": 0.5}]}
    (tmp_path / "hacking.jsonl").write_text(json.dumps(record) + "\n")
    _, findings = examine(tmp_path)
    hack = next(f for f in findings if f.name == "reward_hacking")
    assert hack.first_step == 25 and hack.example["completion"] == "#### " and "1 more" in hack.example["note"]


@pytest.mark.parametrize("sign", H.SIGNS)
def test_every_sign_has_a_key_a_name_and_a_positive_threshold_or_none(sign):
    level = getattr(H.Thresholds(), sign)
    assert (level is None or level > 0) and H.KEYS[sign].startswith("hacking/") and H.NAMES[sign]


def test_diagnose_orders_the_early_finding_with_the_others():
    hacked = run_rows(**{"hacking/honeypot_paid": lambda s: 0.5 if s % 10 == 0 else None})
    assert "reward_hacking" in [f.name for f in diagnose(hacked, FACTS)]
