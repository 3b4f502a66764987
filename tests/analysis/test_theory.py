"""Tests of grpolab.analysis.theory and ``grpolab theory``: the Foundations paper's App. A.2 Hoeffding
table and Thm 4.1, Monte Carlo next to closed forms.

Unit: the bound and the exact binomial tail against values computed here by hand or in
exact rational arithmetic. Statistical: the Monte Carlo column within 4 binomial standard
errors of the exact probability. Smoke: the CLI subcommands, JSON output and bad arguments.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
from helpers.cli import run_cli as _run_cli

from grpolab.analysis.theory import AdvantagesConfig, HoeffdingConfig, advantages_check, hoeffding_rows

GRID = [(R, eps) for R in (2, 4, 8, 16) for eps in (0.3, 0.2, 0.1)]  # App. A.2's table


def _tail(R: int, p: float, eps: float) -> float:
    """P(|K/R - p| > eps), K ~ Bin(R, p), in exact rational arithmetic: ties |k/R - p| = eps
    (e.g. R = 2, p = 0.6, eps = 0.1, k = 1) are decided exactly, not by rounding."""
    pf, ef = Fraction(str(p)), Fraction(str(eps))
    return float(
        sum(math.comb(R, k) * pf**k * (1 - pf) ** (R - k) for k in range(R + 1) if abs(Fraction(k, R) - pf) > ef)
    )


def _within_4_se(mc: float, exact: float, trials: int) -> bool:
    se = math.sqrt(exact * (1 - exact) / trials)
    return abs(mc - exact) <= 4 * se if se > 0 else mc == exact


@pytest.fixture(scope="module")
def rows_p05():
    return hoeffding_rows(HoeffdingConfig(trials=20_000))  # p = 0.5, the default


def test_hoeffding_grid_and_bound(rows_p05):
    assert [(r["R"], r["eps"]) for r in rows_p05] == GRID
    for r in rows_p05:
        assert r["bound"] == pytest.approx(2 / math.e ** (2 * r["R"] * r["eps"] ** 2), rel=1e-12)
    by = {(r["R"], r["eps"]): r for r in rows_p05}
    # by hand: 2 e^{-2*2*0.09} = 2 e^{-0.36} = 1.3954; 2 e^{-2*8*0.09} = 2 e^{-1.44} = 0.4739;
    # 2 e^{-2*16*0.09} = 2 e^{-2.88} = 0.1122; 2 e^{-2*16*0.04} = 2 e^{-1.28} = 0.5560
    # (App. A.2's printed table has 1.34, 0.44 and 0.10 for the first three: its arithmetic, not the bound's)
    assert by[2, 0.3]["bound"] == pytest.approx(1.3954, abs=1e-4)
    assert by[8, 0.3]["bound"] == pytest.approx(0.4739, abs=1e-4)
    assert by[16, 0.3]["bound"] == pytest.approx(0.1122, abs=1e-4)
    assert by[16, 0.2]["bound"] == pytest.approx(0.5560, abs=1e-4)


def test_hoeffding_exact_column_is_the_binomial_tail(rows_p05):
    by = {(r["R"], r["eps"]): r for r in rows_p05}
    # by hand: R = 4, p = 0.5, eps = 0.3: |k/4 - 0.5| in (0.5, 0.25, 0, 0.25, 0.5) > 0.3 only for k = 0, 4: 2/16
    assert by[4, 0.3]["exact"] == pytest.approx(0.125, abs=1e-15)
    # R = 2, any eps < 0.5: |k/2 - 0.5| > eps for k = 0, 2: 1/4 + 1/4
    for eps in (0.3, 0.2, 0.1):
        assert by[2, eps]["exact"] == pytest.approx(0.5, abs=1e-15)
    # R = 8, eps = 0.2: |k - 4| > 1.6 for k in {0, 1, 2, 6, 7, 8}: (1 + 8 + 28 + 28 + 8 + 1) / 256 = 74/256
    assert by[8, 0.2]["exact"] == pytest.approx(74 / 256, abs=1e-15)
    for r in rows_p05:
        assert r["exact"] == pytest.approx(_tail(r["R"], 0.5, r["eps"]), abs=1e-12), r


def test_hoeffding_monte_carlo_within_4_standard_errors(rows_p05):
    for r in rows_p05:
        assert _within_4_se(r["mc"], _tail(r["R"], 0.5, r["eps"]), 20_000), r


def test_hoeffding_bound_holds_where_it_is_not_vacuous(rows_p05):
    informative = [r for r in rows_p05 if r["bound"] < 1]
    assert {(r["R"], r["eps"]) for r in informative} == {(4, 0.3), (8, 0.3), (16, 0.3), (16, 0.2)}
    for r in informative:
        assert r["exact"] <= r["bound"], r


@pytest.mark.parametrize(
    "p,R,eps,expected",
    [
        # |k/2 - 0.6| = (0.6, 0.1, 0.4): > 0.1 for k = 0, 2 only (k = 1 is a tie): 0.4^2 + 0.6^2 = 0.52
        (0.6, 2, 0.1, 0.52),
        # |k/2 - 0.7| = (0.7, 0.2, 0.3): > 0.3 for k = 0 only (k = 2 is a tie): 0.3^2 = 0.09
        (0.7, 2, 0.3, 0.09),
        # |k/4 - 0.6| = (0.6, 0.35, 0.1, 0.15, 0.4): > 0.1 for k != 2: 1 - 6 * 0.36 * 0.16 = 0.6544
        (0.6, 4, 0.1, 0.6544),
    ],
)
def test_hoeffding_ties_at_the_threshold_are_decided_exactly(p, R, eps, expected):
    # |v_R - v| = eps exactly is not a deviation "> eps"; both columns must agree on that,
    # whatever the floating-point rounding of k/R - p (float32 for mc, float64 for exact).
    assert _tail(R, p, eps) == pytest.approx(expected, abs=1e-12)
    (row,) = hoeffding_rows(HoeffdingConfig(p=p, group_sizes=(R,), eps=(eps,), trials=20_000))
    assert row["exact"] == pytest.approx(expected, abs=1e-12), row
    assert _within_4_se(row["mc"], expected, 20_000), row


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_hoeffding_rejects_p_outside_unit_interval(p):
    with pytest.raises(ValueError, match="--p"):
        hoeffding_rows(HoeffdingConfig(p=p, trials=10))


# ---------------------------------------------------------------- Thm 4.1 Monte Carlo


def test_advantages_check_matches_theorem_4_1():
    res = advantages_check(AdvantagesConfig(R=8, p=0.3, eps=0.2, trials=100_000))
    assert set(res) == {
        "var_emp",
        "var_theory",
        "cov_emp",
        "cov_theory",
        "eff_frac_emp",
        "eff_bound",
        "max_abs_group_sum",
    }
    assert res["var_theory"] == pytest.approx(7 / 8 * 0.21)  # (R-1)/R p(1-p)
    assert res["cov_theory"] == pytest.approx(-0.21 / 8)
    assert res["var_emp"] == pytest.approx(res["var_theory"], rel=0.01)
    assert res["cov_emp"] == pytest.approx(res["cov_theory"], rel=0.03)
    assert res["eff_bound"] == 1.0  # 7 * 0.21 / (8 * 0.04) = 4.6, capped
    assert 0.0 <= res["eff_frac_emp"] <= 1.0
    assert res["max_abs_group_sum"] < 1e-5


@pytest.mark.parametrize("cfg", [AdvantagesConfig(R=1, trials=10), AdvantagesConfig(p=2.0, trials=10)])
def test_advantages_check_rejects_bad_config(cfg):
    with pytest.raises(ValueError):
        advantages_check(cfg)


# ---------------------------------------------------------------- CLI smoke


@pytest.mark.slow
def test_cli_theory_hoeffding_json(tmp_path):
    res = _run_cli(["theory", "hoeffding", "--json", "--trials", "20000"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout)
    assert isinstance(rows, list)
    assert [(r["R"], r["eps"]) for r in rows] == GRID
    for r in rows:
        assert {"R", "eps", "bound", "mc"} <= r.keys()
        assert r["bound"] == pytest.approx(2 * math.exp(-2 * r["R"] * r["eps"] ** 2))
        assert _within_4_se(r["mc"], _tail(r["R"], 0.5, r["eps"]), 20_000), r


@pytest.mark.slow
def test_cli_theory_advantages_json(tmp_path):
    res = _run_cli(["theory", "advantages", "--R", "8", "--p", "0.3", "--json", "--trials", "20000"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert {
        "var_emp",
        "var_theory",
        "cov_emp",
        "cov_theory",
        "eff_frac_emp",
        "eff_bound",
        "max_abs_group_sum",
    } <= out.keys()
    assert out["var_theory"] == pytest.approx(7 / 8 * 0.21)
    assert out["var_emp"] == pytest.approx(7 / 8 * 0.21, rel=0.03)  # 20k groups: SE ~ 0.3 %


BAD_ARGS = {
    "hoeffding --p 2": ["theory", "hoeffding", "--p", "2"],
    "advantages --R 1": ["theory", "advantages", "--R", "1"],
}


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("theory_bad")
    return {name: _run_cli(args, cwd) for name, args in BAD_ARGS.items()}


@pytest.mark.parametrize("name", list(BAD_ARGS))
@pytest.mark.slow
def test_cli_theory_bad_args_exit_nonzero(bad_runs, name):
    assert bad_runs[name].returncode != 0


@pytest.mark.parametrize("name", list(BAD_ARGS))
@pytest.mark.slow
def test_cli_theory_bad_args_give_a_one_line_error_not_a_traceback(bad_runs, name):
    # As `grpolab train --group-size 1` does (tests/config/test_config.py): the flag named, no crash.
    res = bad_runs[name]
    flag = name.split()[1]
    assert flag in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr[-1500:]


@pytest.mark.slow
def test_cli_theory_without_subcommand(tmp_path):
    res = _run_cli(["theory"], tmp_path)
    assert res.returncode == 2
    assert "hoeffding" in res.stdout and "advantages" in res.stdout
