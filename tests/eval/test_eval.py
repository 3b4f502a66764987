"""``grpolab eval`` and the accuracy intervals: the CLI on the built-in model (fast tier).

The intervals are checked against independent computations (the Wilson bound as the root of
its defining equation; the clustered interval with numpy), and ``grpolab eval`` on a run must
reproduce the run's own evaluation at its start and at its checkpoint.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers.cli import run_cli

from grpolab.common.stats import Z95, clustered_accuracy_interval, default_pass_k, pass_at_k, wilson_interval
from grpolab.eval.accuracy import accuracy_summary
from grpolab.training.runlog import read_metrics


def _wilson_by_bisection(k: int, n: int) -> tuple[float, float]:
    """The p with |k/n - p| = z sqrt(p (1 - p) / n), found by bisection on each side of k/n."""
    phat = k / n

    def f(p):
        return (phat - p) ** 2 - Z95**2 * p * (1 - p) / n

    def root(a, b):  # f changes sign on [a, b]
        for _ in range(200):
            m = (a + b) / 2
            a, b = (m, b) if (f(a) > 0) == (f(m) > 0) else (a, m)
        return (a + b) / 2

    lo = 0.0 if k == 0 else root(0.0, phat)
    hi = 1.0 if k == n else root(phat, 1.0)
    return lo, hi


@pytest.mark.parametrize("k,n", [(0, 20), (1, 20), (7, 20), (20, 20), (46, 100), (3, 500)])
def test_wilson_matches_its_defining_equation(k, n):
    lo, hi = wilson_interval(k, n)
    want = _wilson_by_bisection(k, n)
    assert lo == pytest.approx(want[0], abs=1e-9) and hi == pytest.approx(want[1], abs=1e-9)
    assert lo <= k / n <= hi


def test_wilson_covers_at_about_95_percent():
    rng = np.random.default_rng(0)
    p, n, trials = 0.3, 50, 4000
    ks = rng.binomial(n, p, size=trials)
    cover = np.mean([lo <= p <= hi for lo, hi in (wilson_interval(int(k), n) for k in ks)])
    assert 0.93 <= cover <= 0.97, cover  # a Wald interval or a wrong z would miss this band


def test_clustered_interval_is_normal_over_questions():
    per_q = [0.0, 0.25, 0.5, 1.0, 0.75, 0.0, 0.25, 0.25]
    lo, hi = clustered_accuracy_interval(per_q)
    m, se = np.mean(per_q), np.std(per_q, ddof=1) / math.sqrt(len(per_q))
    assert (lo, hi) == pytest.approx((m - Z95 * se, m + Z95 * se))
    assert clustered_accuracy_interval([0.0, 0.0, 0.0]) == (0.0, 0.0)


def test_accuracy_summary_per_category():
    greedy = [1.0, 0.0, 1.0, 1.0]
    sampled = [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]]
    m = accuracy_summary(greedy, sampled, ["a", "b", "a", "b"])
    assert m["eval/accuracy_greedy"] == 0.75 and m["eval/accuracy_sampled"] == 0.5
    assert m["eval/greedy_a"] == 1.0 and m["eval/greedy_b"] == 0.5
    assert m["eval/sampled_a"] == 0.75 and m["eval/sampled_b"] == 0.25
    assert (m["eval/greedy_b_lo"], m["eval/greedy_b_hi"]) == pytest.approx(wilson_interval(1, 2))
    assert (m["eval/sampled_a_lo"], m["eval/sampled_a_hi"]) == pytest.approx(clustered_accuracy_interval([0.5, 1.0]))


def _pass_by_enumeration(n: int, c: int, k: int) -> float:
    """pass@k by brute force: the share of the k-subsets of n samples (c of them right) that hold a right one."""
    import itertools

    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_enumeration_over_every_subset(n):
    for c in range(n + 1):
        values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
        for k, v in zip(range(1, n + 1), values):
            assert v == pytest.approx(_pass_by_enumeration(n, c, k), abs=1e-12)
            assert values[0] - 1e-12 <= v <= 1.0  # between pass@1 (= c / n) and 1
        assert values[0] == pytest.approx(c / n) and values == sorted(values)  # non-decreasing in k


def test_pass_at_k_is_not_the_best_of_the_first_k():
    # 8 samples, the right one last: the first 4 hold none, but a random 4 of 8 hold it half of the time
    assert pass_at_k(8, 1, 4) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    assert default_pass_k(8) == (1, 2, 4, 8) and default_pass_k(6) == (1, 2, 4, 6) and default_pass_k(1) == (1,)


def test_accuracy_summary_gives_pass_at_k_with_intervals_over_questions():
    sampled = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0]]
    m = accuracy_summary([1.0, 0.0, 1.0], sampled, ["a"] * 3, (1, 4))
    assert m["eval/pass@1"] == pytest.approx(m["eval/accuracy_sampled"])
    assert m["eval/pass@4"] == pytest.approx(2 / 3)  # the first and third questions have a right sample
    per_q = [1.0, 0.0, 1.0]
    assert (m["eval/pass@4_lo"], m["eval/pass@4_hi"]) == pytest.approx(clustered_accuracy_interval(per_q))
    assert "eval/pass@2" in accuracy_summary([1.0], [[1.0, 0.0]], ["a"])  # default: 1, 2
    with pytest.raises(ValueError, match="pass@8 needs at least 8"):
        accuracy_summary([1.0], [[1.0, 0.0]], ["a"], (8,))
    # a reward that is not 0/1 has no pass@k
    assert not any(k.startswith("eval/pass@") for k in accuracy_summary([0.5], [[0.5, 0.2]], ["a"]))


def test_pass_k_options_are_checked():
    from grpolab.commands.eval import EvalConfig
    from grpolab.config.train import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match="--pass-k: pass@8 needs --samples >= 8"):
        EvalConfig(samples=4, pass_k=(1, 8)).validate()
    with pytest.raises(ConfigError, match="--pass-k: each k must be >= 1"):
        EvalConfig(samples=4, pass_k=(0,)).validate()
    with pytest.raises(ConfigError, match="--pass-k: pass@8 needs --eval-samples >= 8"):
        TrainConfig(eval_samples=4, pass_k=(8,)).validate()


@pytest.mark.slow
def test_eval_cli_on_builtin(tmp_path):
    res = run_cli(
        ["eval", "--questions", "30", "--samples", "2", "--json", str(tmp_path / "e.json"), "--threads", "1"],
        tmp_path,
        300,
    )
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "e.json").read_text())
    m = report["metrics"]
    assert report["questions"] == 30 and sum(report["categories"].values()) == 30
    for cat in ("add_sub_2", "add_sub_3", "mul", "div", "paren"):
        assert f"eval/greedy_{cat}" in m and f"eval/sampled_{cat}_hi" in m
        assert cat in res.stdout
    assert m["eval/accuracy_greedy_lo"] <= m["eval/accuracy_greedy"] <= m["eval/accuracy_greedy_hi"]
    # the built-in warm start solves about half of the test set greedily (0.54 on 500 questions)
    assert 0.25 <= m["eval/accuracy_greedy"] <= 0.85
    assert len(report["examples"]) == 30 and "sampled_correct" in report["examples"][0]
    assert m["eval/pass@1"] <= m["eval/pass@2"] <= 1 and "pass@k" in res.stdout


def _eval(**kw) -> dict:
    """``grpolab eval`` from Python: a run's own task options are the defaults."""
    import grpolab

    return grpolab.evaluate(threads=1, progress=False, log=lambda *a, **k: None, **kw)


@pytest.mark.slow
def test_eval_reproduces_a_runs_own_evaluation(tmp_path):
    from grpolab.config.train import TrainConfig
    from grpolab.training.recipe import train

    run = tmp_path / "run"
    train(
        TrainConfig(
            out=str(run),
            steps=2,
            prompts_per_step=4,
            group_size=4,
            eval_questions=12,
            eval_samples=2,
            lr=1e-3,
            warmup_steps=0,
            max_operand=50,
            categories=("add_sub_2", "mul"),
            few_shot=1,
            progress=False,
            threads=1,
            seed=3,
            device="cpu",
        ),
        log=lambda *a, **k: None,
    )
    logged = {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if "eval/accuracy_greedy" in r}
    for step in (0, 2):
        report = _eval(model=str(run), step=step, questions=12, samples=2)
        assert report["task"]["max_operand"] == 50 and report["task"]["few_shot"] == 1  # the run's task
        for key in ("eval/accuracy_greedy", "eval/accuracy_sampled", "eval/greedy_mul"):
            assert report["metrics"][key] == pytest.approx(logged[step][key]), (step, key)
    assert (
        _eval(model=str(run), questions=12, samples=2)["metrics"] == report["metrics"]
    )  # newest checkpoint by default
    # the completions do not depend on how many are drawn at once (the run's evaluation draws 1024 at once)
    small = _eval(model=str(run), questions=12, samples=2, batch_size=5)["metrics"]
    assert {k: v for k, v in small.items() if not k.startswith("time/")} == {
        k: v for k, v in report["metrics"].items() if not k.startswith("time/")
    }
    # a step that was not saved is refused in one line
    res = run_cli(["eval", "--model", str(run), "--step", "1", "--questions", "4", "--no-progress"], tmp_path, 120)
    assert res.returncode == 2 and "checkpoints of steps [2]" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_eval_of_a_lora_run_puts_the_adapter_on_the_base(tmp_path):
    from grpolab.config.train import TrainConfig
    from grpolab.training.recipe import train

    run = tmp_path / "lora"
    train(
        TrainConfig(
            out=str(run),
            steps=1,
            prompts_per_step=4,
            group_size=4,
            eval_questions=10,
            eval_samples=1,
            lora_rank=4,
            lr=5e-3,
            warmup_steps=0,
            progress=False,
            threads=1,
            device="cpu",
        ),
        log=lambda *a, **k: None,
    )
    logged = [r for r in read_metrics(run / "metrics.jsonl") if "eval/accuracy_greedy" in r][-1]
    report = _eval(model=str(run / "checkpoints" / "step_1"), questions=10, samples=1)
    assert report["weights"] == "builtin" and report["adapter"].endswith("step_1")
    assert report["metrics"]["eval/accuracy_greedy"] == pytest.approx(logged["eval/accuracy_greedy"])
    assert report["metrics"]["eval/accuracy_sampled"] == pytest.approx(logged["eval/accuracy_sampled"])
