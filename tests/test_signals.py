"""The run's signals read (grpolab.probes.signals) against hand-worked values, and the report's signal panel."""

from __future__ import annotations

from grpolab.probes.signals import onset, readings, saturation_step, since
from grpolab.report.page import signal_panel


def test_the_saturation_step_is_where_the_accuracy_reaches_nine_tenths_of_its_gain():
    evals = [(0, 0.2), (3, 0.3), (6, 0.65), (9, 0.75), (12, 0.8), (15, 0.78)]
    assert saturation_step(evals) == 9  # the first at or above 0.2 + 0.9 * 0.6 = 0.74
    assert saturation_step([(0, 0.5), (5, 0.4)]) is None  # no gain
    assert saturation_step([(0, 0.5)]) is None


def test_a_signals_onset_is_half_way_to_its_extreme():
    rank = [(0, 6.0), (3, 5.5), (6, 4.1), (9, 3.9), (12, 2.0)]
    assert onset(rank, falling=True) == 9  # half-way: 6 - 0.5 * 4 = 4.0
    assert onset([(0, 0.1), (3, 0.2), (6, 0.6)], falling=False) == 6  # 0.1 + 0.5 * 0.5 = 0.35
    assert onset([(0, 1.0), (3, 1.0)], falling=True) is None and onset([(0, 1.0)], falling=True) is None
    assert since([(0, 3.0), (5, 1.5), (10, 2.5), (15, 1.8), (20, 1.2)], 2.0) == 15
    assert since([(0, 1.0), (5, 2.5)], 2.0) is None


def _rows():
    return [
        {"step": 0, "eval/accuracy_greedy": 0.2},
        *[
            {
                "step": s,
                "probe/eff_rank": r,
                "probe/eff_rank_half": r / 2,
                "reward/group_std_mean": sd,
                "reward/frac_zero_std": z,
                **({"eval/accuracy_greedy": a} if a is not None else {}),
            }
            for s, r, sd, z, a in [(5, 4.0, 0.45, 0.1, 0.5), (10, 1.9, 0.3, 0.4, 0.75), (15, 1.5, 0.2, 0.6, 0.8)]
        ],
    ]


def test_each_signal_gets_one_plain_line():
    lines = readings(_rows())
    assert lines[0] == (
        "effective rank 1.50 at step 15 (4.00 at step 5); below 2 since step 10: each group's update moves along "
        "fewer than two directions; at half the group size 0.75"
    )
    assert lines[1].startswith("reward spread in a group sigma_r 0.450 at step 5, 0.200 at step 15")
    assert lines[2].startswith("60% of the groups at step 15 had equal rewards") and "most groups are spent" in lines[2]
    assert lines[3] == "saturation at step 10: greedy held-out accuracy reached 90% of its gain over the run"


def test_the_report_panel_draws_the_signals_only_for_a_probed_run():
    html = signal_panel(_rows())
    assert html.startswith('<img alt="signals over training" src="data:image/png;base64,') and html.count("<li>") == 4
    assert signal_panel([{"step": 1, "reward/frac_zero_std": 0.5}]) == ""
