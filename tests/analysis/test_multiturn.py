"""Multi-turn credit [Foundations, Sec. 6]: the chain's exact bias, its Monte Carlo check, the dialogue, training."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from helpers.cli import run_cli

from grpolab.algo.advantages import turn_advantages
from grpolab.analysis.multiturn_chain import STAGE_ADVANTAGES, Chain, conditional_bias, exact_bias, monte_carlo_bias
from grpolab.data.dialogues import DialogueSpec, make_dialogues, question


def _trajectories(chain: Chain):
    """Every success pattern of the chain with its probability."""
    for xs in itertools.product((0, 1), repeat=chain.H):
        p, s = 1.0, 1
        for x in xs:
            q = chain.q(s)
            p *= q if x else 1 - q
            s = x
        yield xs, p


# ---------------------------------------------------------------- the chain, exactly


def test_chain_values_by_hand():
    c = Chain(H=2, q1=0.8, q0=0.3)
    v = c.values()
    assert v[2][1] == pytest.approx(0.8) and v[2][0] == pytest.approx(0.3)
    assert v[1][1] == pytest.approx(0.8 * (1 + 0.8) + 0.2 * 0.3)
    # v_1(1) is the expected total return
    assert v[1][1] == pytest.approx(sum(p * sum(xs) for xs, p in _trajectories(c)))


@pytest.mark.parametrize("H,q1,q0", [(3, 0.8, 0.3), (4, 0.6, 0.1), (3, 0.2, 0.9)])
def test_eq23_holds_by_enumeration(H, q1, q0):
    # E[total - v_1 - A(s_h, a_h) | history up to h] computed from every trajectory equals k + v_h(s) - v_1(1).
    c = Chain(H, q1, q0)
    v = c.values()
    for h in range(1, H + 1):
        num, den = {}, {}
        for xs, p in _trajectories(c):
            k, s = sum(xs[: h - 1]), (1 if h == 1 else xs[h - 2])
            x = xs[h - 1]
            A = (1 + v[h + 1][1] if x else v[h + 1][0]) - v[h][s]
            e = sum(xs) - v[1][1] - A
            num[(k, s)] = num.get((k, s), 0.0) + p * e
            den[(k, s)] = den.get((k, s), 0.0) + p
        for (k, s), pr in den.items():
            leak, mis = conditional_bias(c, v, h, k, s, "grpo")
            assert num[(k, s)] / pr == pytest.approx(leak + mis, abs=1e-12), (h, k, s)


def test_exact_bias_properties():
    rows = exact_bias(Chain(4, 0.8, 0.3))
    by = {(r["stage"], r["estimator"]): r for r in rows}
    for est in STAGE_ADVANTAGES:
        assert by[(1, est)]["bias_rms"] == 0.0 and by[(1, est)]["bias_mean"] == 0.0  # single-turn: exact
    for h in range(1, 5):
        assert by[(h, "grpo")]["bias_mean"] == pytest.approx(0.0, abs=1e-12)  # zero on average by construction
        assert by[(h, "rtg-mc")]["bias_rms"] == 0.0
        assert by[(h, "rtg-group")]["leakage_rms"] == 0.0
    rms = [by[(h, "grpo")]["bias_rms"] for h in range(1, 5)]
    assert all(a < b for a, b in zip(rms, rms[1:]))  # the history-conditional bias grows with the stage
    # leakage RMS is sqrt(E k^2) of the past successes
    c = Chain(4, 0.8, 0.3)
    ek2 = sum(p * sum(xs[:2]) ** 2 for xs, p in _trajectories(c))
    assert by[(3, "grpo")]["leakage_rms"] == pytest.approx(math.sqrt(ek2))


@pytest.mark.slow
def test_chain_monte_carlo_inside_ci_of_exact_at_every_stage():
    # The acceptance: H = 4, every stage, within the Monte Carlo 95% CI; stage 1 exactly 0.
    c = Chain(4, 0.8, 0.3)
    exact = {(r["stage"], r["estimator"]): r["bias_rms"] for r in exact_bias(c)}
    rows = monte_carlo_bias(c, R=8, groups=50_000, seed=0)
    assert len(rows) == 12
    for r in rows:
        ex = exact[(r["stage"], r["estimator"])]
        assert r["ci_low"] <= ex <= r["ci_high"], (r, ex)
    assert all(exact[(1, e)] == 0.0 for e in STAGE_ADVANTAGES)


@pytest.mark.slow
def test_a_wrong_bias_formula_would_be_caught():
    # Leaving out the value mismatch (bias = past rewards only) is far outside the CI from stage 2 on.
    c = Chain(4, 0.8, 0.3)
    rows = monte_carlo_bias(c, R=8, groups=20_000, seed=1, boot=100)
    leak_only = {r["stage"]: r["leakage_rms"] for r in exact_bias(c) if r["estimator"] == "grpo"}
    for r in rows:
        if r["estimator"] == "grpo" and r["stage"] > 1:
            assert not r["ci_low"] <= leak_only[r["stage"]] <= r["ci_high"]


def test_chain_rejects_bad_parameters():
    with pytest.raises(ValueError):
        Chain(0)
    with pytest.raises(ValueError):
        Chain(3, q1=1.5)
    with pytest.raises(ValueError):
        monte_carlo_bias(Chain(3), R=1, groups=10)


# ---------------------------------------------------------------- per-stage advantages and the dialogue


def test_turn_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)  # [G=2, H=3]
    turns = torch.tensor([3, 3])
    # totals 2 and 0, group mean 1 [Foundations, Eq. 22]: the total minus the mean at every turn
    assert torch.equal(turn_advantages(r, turns, "grpo"), torch.tensor([[1.0, 1, 1], [-1, -1, -1]]))
    # reward-to-go (2, 1, 1) and (0, 0, 0) minus the group mean of totals
    assert torch.equal(turn_advantages(r, turns, "grpo", "rtg-group"), torch.tensor([[1.0, 0, 0], [-1, -1, -1]]))
    v = torch.full_like(r, 0.5)
    assert torch.equal(
        turn_advantages(r, turns, "grpo", "rtg-mc", v), torch.tensor([[1.5, 0.5, 0.5], [-0.5, -0.5, -0.5]])
    )
    with pytest.raises(ValueError):
        turn_advantages(r, turns, "grpo", "rtg-mc")
    with pytest.raises(ValueError):
        turn_advantages(r, turns, "grpo", "nope")


def test_dialogue_truths_follow_the_questions():
    spec = DialogueSpec(stages=3, max_operand=50)
    for d in make_dialogues(50, 5, spec):
        prev = None
        for h in range(3):
            q = question(d, h, prev)
            assert eval(q) == d["truths"][h]  # the questions asked with the true previous answers
            prev = str(d["truths"][h])
        # a wrong previous answer changes the next question, not the truth
        assert question(d, 1, "12345").startswith("12345")
    assert make_dialogues(3, 1, spec) == make_dialogues(3, 1, spec)


# ---------------------------------------------------------------- commands and training


@pytest.mark.slow
def test_cli_multiturn_chain_writes_records(tmp_path):
    res = run_cli(
        [
            "multiturn",
            "--env",
            "chain",
            "--stages",
            "3",
            "--group-size",
            "4",
            "--groups",
            "4000",
            "--bootstrap",
            "50",
            "--out",
            "mt",
            "--json",
            "mt.json",
        ],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    records = json.loads((tmp_path / "mt.json").read_text())
    assert {(r["stage"], r["estimator"]) for r in records} == {(h, e) for h in (1, 2, 3) for e in STAGE_ADVANTAGES}
    keys = {
        "stage",
        "estimator",
        "bias_mean",
        "bias_rms",
        "ci_low",
        "ci_high",
        "leakage_rms",
        "mismatch_rms",
        "bias_rms_exact",
    }
    assert all(keys <= set(r) for r in records)
    assert (tmp_path / "mt" / "multiturn.png").is_file()
    assert json.loads((tmp_path / "mt" / "multiturn.json").read_text())["records"] == records


@pytest.mark.parametrize(
    "args,flag", [(["--group-size", "1"], "--group-size"), (["--env", "x"], "--env"), (["--q1", "2"], "--q0 and --q1")]
)
@pytest.mark.slow
def test_cli_multiturn_bad_config(tmp_path, args, flag):
    res = run_cli(["multiturn", *args], tmp_path)
    assert res.returncode == 2 and flag in res.stderr and "Traceback" not in res.stderr, res.stderr


@pytest.mark.slow
def test_arith_bias_measurement_smoke(tmp_path):
    from grpolab.analysis.multiturn import MultiturnConfig, run_multiturn

    rows = run_multiturn(
        MultiturnConfig(
            env="arith",
            stages=2,
            group_size=2,
            episodes=2,
            branches=2,
            bootstrap=20,
            max_new_tokens=24,
            out=str(tmp_path / "a"),
        ),
        log=lambda *a: None,
    )
    assert {(r["stage"], r["estimator"]) for r in rows} == {(h, e) for h in (1, 2) for e in STAGE_ADVANTAGES}
    for r in rows:
        assert all(
            math.isfinite(r[k]) for k in ("bias_mean", "bias_rms", "ci_low", "ci_high", "leakage_rms", "mismatch_rms")
        )
        assert r["ci_low"] <= r["ci_high"]
    stage1 = [r for r in rows if r["stage"] == 1 and r["estimator"] in ("grpo", "rtg-group")]
    assert all(r["bias_rms"] == 0.0 and r["leakage_rms"] == 0.0 for r in stage1)


@pytest.mark.parametrize("advantage", ["grpo", "rtg-group", "rtg-mc"])
@pytest.mark.slow
def test_multiturn_training_smoke(tmp_path, advantage):
    from grpolab.config.train import TrainConfig
    from grpolab.models.policy import load_policy
    from grpolab.training.recipe import train
    from grpolab.training.runlog import read_metrics

    before = {n: p.detach().clone() for n, p in load_policy("builtin").model.named_parameters()}
    cfg = TrainConfig(
        task="arith-multiturn",
        advantage=advantage,
        stages=2,
        branches=2,
        steps=2,
        prompts_per_step=2,
        group_size=4,
        max_new_tokens=24,
        eval_every=0,
        eval_questions=6,
        lr=1e-3,
        warmup_steps=0,
        out=str(tmp_path / "run"),
        progress=False,
    )
    out = train(cfg, log=lambda *a: None)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("eval/stage1_greedy", "eval/stage2_greedy", "eval/stage1_sampled", "eval/accuracy_greedy"):
        assert key in rows[0] and key in rows[-1]
    assert all(math.isfinite(rows[-1][k]) for k in ("reward/mean", "reward/stage1", "reward/stage2", "grad/norm"))
    after = load_policy(str(out / "checkpoints" / "step_2")).model
    changed = any(not torch.equal(before[n], p) for n, p in after.named_parameters())
    assert changed == any(r["loss/active_frac"] > 0 for r in rows[1:])


def test_multiturn_config_is_validated():
    from grpolab.config.train import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match="--advantage"):
        TrainConfig(task="arith-multiturn", advantage="nope").validate()
    with pytest.raises(ConfigError, match="--stages"):
        TrainConfig(task="arith-multiturn", stages=0).validate()
    with pytest.raises(ConfigError, match="--advantage"):
        TrainConfig(advantage="rtg-group").validate()  # a single-turn task has one turn


@pytest.mark.slow
def test_multiturn_lora_resume_continues_with_the_episodes_of_the_uninterrupted_run(tmp_path):
    import shutil

    from grpolab.config.train import TrainConfig
    from grpolab.training.recipe import train
    from grpolab.training.runlog import read_metrics

    def cfg(out, **kw):
        return TrainConfig(
            task="arith-multiturn",
            advantage="rtg-group",
            stages=2,
            steps=2,
            prompts_per_step=4,
            group_size=8,
            max_new_tokens=24,
            eval_every=0,
            eval_questions=4,
            lr=1e-2,
            warmup_steps=0,
            lora_rank=2,
            save_every=1,
            out=str(out),
            progress=False,
            log_rollouts=True,
            **kw,
        )

    full = train(cfg(tmp_path / "full"), log=lambda *a: None)
    assert read_metrics(full / "metrics.jsonl")[1]["loss/active_frac"] > 0  # step 1 moved the adapter
    shutil.copytree(full, tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_2")
    train(cfg(tmp_path / "resumed", resume=True), log=lambda *a: None)
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
    assert [strip(r) for r in read_metrics(full / "metrics.jsonl")] == [
        strip(r) for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    ]
    # the resumed run played step 2's episodes as the uninterrupted one did, turn by turn
    episodes = (full / "rollouts.jsonl").read_text()
    assert episodes == (tmp_path / "resumed" / "rollouts.jsonl").read_text() and '"turn_rewards"' in episodes


def test_a_stage_reached_from_one_record_has_no_interval(tmp_path):
    """Bootstrapping over records cannot vary a stage whose episodes all come from one record: no interval (None),
    printed and plotted as such, rather than a degenerate [x, x]."""
    from grpolab.analysis.multiturn import _rms_stats, format_multiturn
    from grpolab.analysis.plots import plot_multiturn

    gen = torch.Generator().manual_seed(0)
    b, noise = torch.tensor([0.3, -0.1, 0.2]), torch.zeros(3)
    rms, lo, hi = _rms_stats(b, noise, torch.zeros(3, dtype=torch.long), 50, gen)
    assert rms == pytest.approx(math.sqrt((0.09 + 0.01 + 0.04) / 3)) and lo is None and hi is None
    rms2, lo2, hi2 = _rms_stats(b, noise, torch.tensor([0, 1, 1]), 50, gen)
    assert rms2 == rms and lo2 <= rms2 <= hi2
    row = {"stage": 3, "estimator": "grpo", "episodes": 3, "bias_mean": 0.13, "bias_rms": rms, "ci_low": None,
           "ci_high": None, "leakage_rms": 0.0, "mismatch_rms": rms}  # fmt: skip
    assert "one record" in format_multiturn([row])
    assert plot_multiturn([row], tmp_path / "m.png").is_file()
