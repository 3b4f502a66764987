"""The doctor (grpolab.doctor): each check at the edge of its thresholds on hand-made metric rows, the ordering of
findings, and each condition caught first on a short built-in run that has exactly that fault; no false alarm on a
healthy run; the watcher in training; `grpolab doctor` and the report's section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import paths
from helpers.cli import run_cli
from helpers.runs import quiet, small_cfg

import grpolab
from grpolab.doctor import conditions as C
from grpolab.doctor import optimisation as O
from grpolab.doctor import rows as R
from grpolab.doctor import signal as S
from grpolab.doctor import task as T
from grpolab.doctor.conditions import Finding, RunFacts, diagnose
from grpolab.doctor.examine import Watcher, examine, format_findings, replay

FIXTURES = paths.FIXTURES / "recorded"  # real runs: config.json, metrics.jsonl, samples.jsonl
FACTS = RunFacts(max_new_tokens=32, group_size=8, lr=1e-5, answer_check="####")


def rows(n: int = 10, **values) -> list[dict]:
    """``n`` training rows of a healthy run (a contrast in most groups, nothing cut, small steady steps), with
    ``values`` set at every step (a list: one value per step)."""
    base = {
        "reward/mean": 0.5, "reward/std": 0.5, "reward/frac_zero_std": 0.1, "reward/accuracy": 0.5,
        "reward/format": 0.9, "reward/errors": 0, "sampling/rollouts": 64, "completion/truncated_frac": 0.0,
        "completion/len_mean": 20.0, "policy/entropy": 0.5, "loss/clip_frac": 0.0, "loss/ratio_mean": 1.0,
        "grad/norm": 1.0, "charts/lr": 1e-5, "doctor/weight_change": 1e-4, "engine/logratio_std": 1e-5,
        "loss/skipped_updates": 0,
    }  # fmt: skip
    out = []
    for i in range(n):
        row = {"step": i + 1, **base}
        for k, v in values.items():
            row[k] = v[i] if isinstance(v, list) else v
        out.append(row)
    return out


def names(found: list[Finding]) -> list[str]:
    return [f.name for f in found]


# ---------------------------------------------------------------- each threshold at its edge


def test_a_healthy_run_has_no_finding():
    assert diagnose(rows(), FACTS) == []
    assert diagnose(rows(2, **{"reward/frac_zero_std": 1.0}), FACTS) == []  # under MIN_STEPS: no check yet


def test_no_signal_at_its_share_and_which_kind():
    edge = S.NO_SIGNAL_SHARE
    assert S.no_signal(rows(**{"reward/frac_zero_std": edge - 1e-9}), FACTS) is None
    wrong = S.no_signal(rows(**{"reward/frac_zero_std": edge, "reward/accuracy": 0.05}), FACTS)
    assert wrong.severity == "error" and "all wrong" in wrong.title
    assert "--group-size 16" in wrong.fix and "--sampling adaptive" in wrong.fix  # 1 - .95^16 - .05^16 = 0.56
    right = S.no_signal(rows(**{"reward/frac_zero_std": edge, "reward/accuracy": S.RIGHT_SHARE}), FACTS)
    assert "all right" in right.title and "harder data" in right.fix
    constant = S.no_signal(rows(**{"reward/frac_zero_std": 1.0, "reward/std": 0.0, "reward/mean": 0.3}), FACTS)
    assert "same reward, 0.3" in constant.title and "check the reward function" in constant.fix
    # the first reward exactly 1 everywhere, the total still varying (a format term): no signal from the task
    task = S.no_signal(rows(**{"reward/accuracy": 1.0}), FACTS)
    assert "gives every completion 1" in task.title and "learns the other terms" in task.evidence
    # a run whose reward rose before its groups ran out of contrast: saturation's case, not this one
    learned = rows(**{"reward/mean": [0.2] * 5 + [0.9] * 5, "reward/frac_zero_std": [0.1] * 5 + [0.9] * 5})
    assert S.no_signal(learned, FACTS) is None and S.saturation(learned, FACTS) is not None


def test_the_group_size_that_gives_a_contrast():
    assert S.contrast_group_size(0.05, 8) == 16  # 1 - .95^16 = 0.56 >= 0.5; G = 8 gives 0.34
    assert S.contrast_group_size(0.02, 8) == 64  # .476 at 32, .726 at 64
    assert S.contrast_group_size(0.001, 8) is None  # past MAX_GROUP: change the data
    assert S.contrast_group_size(0.5, 4) == 8


def test_truncation_at_its_shares_and_the_length_it_recommends():
    share = "completion/truncated_frac"
    assert S.truncation(rows(**{share: S.TRUNC_SHARE - 1e-9}), FACTS) is None  # nothing says the cut ones lose
    warn = S.truncation(rows(**{share: S.TRUNC_SHARE}), FACTS)  # the cut ones' scores unknown: a warning
    assert warn.severity == "warning" and "--max-new-tokens 64" in warn.fix and "20%" in warn.title
    err = S.truncation(rows(**{share: S.TRUNC_SEVERE, "doctor/truncated_reward_gap": 0.0}), FACTS)
    assert err.severity == "error" and "--max-new-tokens 128" in err.fix
    assert S.recommended_length(96, 0.5) == 256 and S.recommended_length(16, 0.9) == 64
    # between the shares, the cut completions' scores decide: lower by TRUNC_GAP, a warning; like the rest, info
    gap = "doctor/truncated_reward_gap"
    assert S.truncation(rows(**{share: 0.5, gap: S.TRUNC_GAP}), FACTS).severity == "warning"
    assert S.truncation(rows(**{share: 0.5, gap: S.TRUNC_GAP - 0.01}), FACTS).severity == "info"
    # under TRUNC_SHARE, a few cut completions that score lower: info, and the evidence says the share alone is under
    few = S.truncation(rows(**{share: S.TRUNC_GAP_SHARE, gap: S.TRUNC_GAP}), FACTS)
    assert few.severity == "info" and f"under the {S.TRUNC_SHARE} that alone is reported" in few.evidence
    assert f"(threshold {S.TRUNC_SHARE};" in warn.evidence
    assert S.truncation(rows(**{share: S.TRUNC_GAP_SHARE - 0.01, gap: 1.0}), FACTS) is None
    # without the metric, the logged rollouts give the gap
    cut = [{"step": 10, "tokens": 32, "reward": 0.0}] * 6
    rest = [{"step": 10, "tokens": 10, "reward": S.TRUNC_GAP}] * 14
    logged = S.truncation(rows(**{share: 0.3}), FACTS, cut + rest)
    assert logged.severity == "warning" and "score 0.10 below" in logged.evidence
    rest = [{"step": 10, "tokens": 10, "reward": S.TRUNC_GAP - 0.01}] * 14
    assert S.truncation(rows(**{share: 0.3}), FACTS, cut + rest).severity == "info"


def test_the_reward_never_sees_an_answer():
    half = 0.5 * 64 * 2  # ERROR_SHARE of 64 rollouts x 2 functions
    assert S.reward_blind(rows(**{"reward/errors": half - 1}), FACTS) is None
    assert "failed on 50%" in S.reward_blind(rows(**{"reward/errors": half}), FACTS).title
    floor = S.FORMAT_FLOOR
    blind = S.reward_blind(rows(**{"reward/format": floor, "reward/accuracy": floor}), FACTS)
    assert blind.severity == "error" and "'#### <number>'" in blind.fix
    assert S.reward_blind(rows(**{"reward/format": floor + 0.01, "reward/accuracy": 0.0}), FACTS) is None
    # a reward function of the user's own: the built-in format check says nothing about it
    own = RunFacts(answer_check="")
    assert S.reward_blind(rows(**{"reward/format": 0.0, "reward/accuracy": 0.0}), own) is None


def test_no_movement_by_the_weights_the_ratio_and_the_kl():
    assert O.no_movement(rows(**{"doctor/weight_change": O.NO_MOVE_CHANGE}), FACTS) is None
    still = O.no_movement(rows(**{"doctor/weight_change": O.NO_MOVE_CHANGE * 0.99}), FACTS)
    assert still.severity == "error" and "--lr 0.001" in still.fix
    one_moves = rows(**{"doctor/weight_change": [1e-9] * 9 + [1e-4]})
    assert O.no_movement(one_moves, FACTS) is None
    # every advantage 0: the weights stand still for no_signal's reason
    assert O.no_movement(rows(**{"doctor/weight_change": 0.0, "reward/frac_zero_std": 1.0}), FACTS) is None
    assert "learning rate is 0" in O.no_movement(rows(**{"charts/lr": 0.0}), FACTS).title
    mu = RunFacts(mu=2, lr=1e-5)
    flat = rows(**{"doctor/weight_change": None, "loss/ratio_mean": 1 + O.RATIO_FLAT / 2})
    assert "between a step's epochs" in O.no_movement(flat, mu).title
    moving = rows(**{"doctor/weight_change": None, "loss/ratio_mean": 1 + O.RATIO_FLAT * 2})
    assert O.no_movement(moving, mu) is None
    kl = RunFacts(beta=0.04, warmup_steps=2)
    assert "left its reference" in O.no_movement(rows(**{"doctor/weight_change": None, "loss/kl": 0.0}), kl).title
    assert O.no_movement(rows(**{"doctor/weight_change": None, "loss/kl": O.KL_FLOOR}), kl) is None


def test_rounding_at_its_share_and_the_change_it_names():
    key = "doctor/weights_unmoved_frac"
    pure = RunFacts(lr=1e-6, precision="bf16-true", compensation="none")
    assert O.rounding(rows(**{key: O.UNMOVED_SHARE - 1e-9}), pure) is None
    found = O.rounding(rows(**{key: O.UNMOVED_SHARE}), pure)
    assert found.severity == "warning" and "--precision bf16-mixed" in found.fix and "--compensation kahan" in found.fix
    assert O.rounding(rows(**{key: O.UNMOVED_SEVERE - 1e-9}), pure).severity == "warning"
    assert O.rounding(rows(**{key: O.UNMOVED_SEVERE}), pure).severity == "error"
    kahan = O.rounding(
        rows(**{key: 0.6, "doctor/weights_unmoved_exact_frac": 0.01}),
        RunFacts(lr=1e-6, precision="bf16-true", compensation="kahan"),
    )
    assert "--compensation" not in kahan.fix and "--precision bf16-mixed" in kahan.fix
    assert "Kahan summation keeps each update (doctor/weights_unmoved_exact_frac 0.010)" in kahan.evidence
    for fp32 in O.FP32_WEIGHTS:  # fp32 weights lose a step only under their own spacing: no_movement's lr
        assert O.rounding(rows(**{key: 0.99}), RunFacts(lr=1e-9, precision=fp32)) is None
    assert O.rounding(rows(**{key: [None] * 8 + [0.99] * 2}), pure) is None  # fewer than MIN_STEPS logged
    assert O.rounding(rows(), pure) is None  # a run recorded before the instrument
    # the precision as config.json records it, or as --dtype did before --precision
    assert (RunFacts.of({"precision": "bf16-mixed"}).precision, RunFacts.of({"dtype": "bfloat16"}).compensation) == (
        "bf16-mixed", "none")  # fmt: skip
    assert RunFacts.of({"dtype": "auto"}).precision == ""


def test_the_facts_are_read_through_the_runs_config():
    """RunFacts.of reads config.json as the config does (TrainConfig.of_run): a missing option is TrainConfig's
    default, or the value a run recorded before it had (BEFORE_RECORDED); keys no option holds are skipped."""
    from grpolab.config.train import TrainConfig
    from grpolab.doctor.examine import RunData, check_every

    defaults = TrainConfig()
    facts = RunFacts.of({"code_version": "abc", "world_size": 2, "hub": "org/x", "model_fingerprint": "f"})
    assert facts.warmup_steps == defaults.optimizer.warmup_steps == 10 and facts.lr == defaults.optimizer.lr
    assert (facts.group_size, facts.mu) == (defaults.groups.group_size, defaults.objective.mu)
    assert RunFacts.of({"warmup_steps": 3}).warmup_steps == 3
    old = {"dtype": "bfloat16", "lr": 1e-6, "steps": 20}  # before --precision, --rollout-dtype, --engine-correction
    cfg = TrainConfig.of_run(old)
    assert (cfg.machine.dtype, cfg.machine.precision, cfg.engine.rollout_dtype) == ("bfloat16", "auto", "auto")
    assert cfg.objective.engine_correction == "none" and cfg.resolved().machine.precision == "bf16-true"
    facts = RunFacts.of(old)
    assert facts.engine_correction == "none" and facts.lr == 1e-6
    machine = cfg.resolved().machine  # --dtype folded into the --precision it stands for
    assert (facts.precision, facts.compensation) == (machine.precision, machine.compensation) == ("bf16-true", "none")
    assert check_every(RunData(Path("."), {}, [], [], [])) == defaults.diagnosis.doctor_every
    assert check_every(RunData(Path("."), {"doctor_every": 7}, [], [], [])) == 7


def test_not_learning_when_the_groups_carry_signal_with_the_causes_it_sees():
    n = O.FLAT_STEPS
    first = {"step": 0, "eval/accuracy_greedy": 0.2, "eval/accuracy_greedy_hi": 0.25}
    last = {"step": n, "eval/accuracy_greedy": 0.25}

    def run(k: int = n, **values) -> list[dict]:
        return [first, *rows(k, **values), last]

    found = O.not_learning(run(), FACTS)
    assert found.severity == "info" and "none of the instruments" in found.evidence  # a slow start looks the same
    rounded = O.not_learning(run(**{"doctor/weights_unmoved_frac": 0.99}), FACTS)
    assert rounded.severity == "warning" and "updates rounded away" in rounded.evidence
    assert rounded.fix == "--precision bf16-mixed"
    assert "barely move" in O.not_learning(run(**{"doctor/weight_change": 9.9 * O.NO_MOVE_CHANGE}), FACTS).evidence
    assert "barely move" not in O.not_learning(run(**{"doctor/weight_change": 10 * O.NO_MOVE_CHANGE}), FACTS).evidence
    assert O.not_learning([first, *rows(n), {**last, "eval/accuracy_greedy": 0.26}], FACTS) is None  # it rose
    assert O.not_learning(rows(n), FACTS) is None  # no held-out evaluation to say it is flat
    assert O.not_learning(run(n - 1), FACTS) is None  # fewer than FLAT_STEPS steps
    assert O.not_learning(run(**{"reward/frac_zero_std": S.NO_SIGNAL_SHARE}), FACTS) is None  # no_signal's case
    assert O.not_learning(run(**{"reward/frac_zero_std": S.NO_SIGNAL_SHARE - 1e-9}), FACTS) is not None
    assert O.not_learning(run(**{"reward/accuracy": R.CEILING}), FACTS) is None  # saturated
    # FLAT_SD: a rise of a quarter of the start's sd (0.5) is flat, more is slow learning
    up = [0.25] * (n - 5) + [0.25 + O.FLAT_SD * 0.5] * 5
    assert O.not_learning(run(**{"reward/mean": up}), FACTS) is not None
    more = [0.25] * (n - 5) + [0.251 + O.FLAT_SD * 0.5] * 5
    assert O.not_learning(run(**{"reward/mean": more}), FACTS) is None
    # a control run at --lr 0: the learning rate is the cause, and the change a learning rate, never "--lr 0"
    control = O.not_learning(run(**{"charts/lr": 0.0, "doctor/weight_change": 0.0}), RunFacts(lr=0.0))
    assert (
        control.severity == "warning" and "the learning rate is 0" in control.evidence and control.fix == "--lr 5e-05"
    )
    # rounding is listed before the not learning it explains
    both = diagnose(run(**{"doctor/weights_unmoved_frac": 0.99}), RunFacts(precision="bf16-true"))
    assert names(both)[:2] == ["rounding", "not_learning"] and C.explained(both[0], both) == ["not_learning"]


@pytest.mark.parametrize(
    ("sampled", "greedy", "reported"),
    [
        ((0.444, 0.485, 0.550), (0.585, 0.63, 0.600), False),  # sampled rose beyond its interval, greedy flat
        ((0.444, 0.485, 0.450), (0.585, 0.63, 0.700), False),  # greedy rose beyond its interval, sampled flat
        ((0.444, 0.485, 0.480), (0.585, 0.63, 0.600), True),  # both within their first intervals: still reported
        ((0.444, 0.485, 0.485), (0.585, 0.63, 0.630), True),  # at the interval's edge is within it
    ],
)
def test_not_learning_agrees_with_the_evaluation_table(sampled, greedy, reported):
    """A run whose held-out accuracy, sampled or greedy, rose beyond its first evaluation's 95% interval is never
    'not learning' (the shapes demo: sampled 0.444 [0.403, 0.485] -> 0.550, greedy 0.585 -> 0.600); with both flat it
    is, and the finding names each accuracy it read."""
    n = O.FLAT_STEPS
    (s0, s_hi, s1), (g0, g_hi, g1) = sampled, greedy
    first = {"step": 0, "eval/accuracy_sampled": s0, "eval/accuracy_sampled_hi": s_hi,
             "eval/accuracy_greedy": g0, "eval/accuracy_greedy_hi": g_hi}  # fmt: skip
    last = {"step": n, "eval/accuracy_sampled": s1, "eval/accuracy_greedy": g1}
    run = [first, *rows(n), last]
    found = O.not_learning(run, FACTS)
    assert (found is not None) == reported
    findings = diagnose(run, FACTS)
    assert ("not_learning" in names(findings)) == reported  # the console's and the report's list
    if reported:
        assert f"eval/accuracy_sampled {s0:.3f} at step 0 -> {s1:.3f}" in found.evidence
        assert f"eval/accuracy_greedy {g0:.3f} at step 0 -> {g1:.3f}" in found.evidence
        assert {"eval/accuracy_sampled", "eval/accuracy_greedy"} <= set(found.keys)


def test_too_big_a_step_by_each_sign():
    assert O.big_step(rows(**{"loss/clip_frac": O.CLIP_HIGH - 1e-9}), FACTS) is None
    assert O.big_step(rows(**{"loss/clip_frac": O.CLIP_HIGH}), FACTS).severity == "warning"
    assert O.big_step(rows(**{"loss/clip_frac": O.CLIP_SEVERE}), FACTS).severity == "error"
    assert O.big_step(rows(**{"loss/ratio_mean": 1 + O.RATIO_DRIFT}), FACTS) is not None
    assert O.big_step(rows(**{"loss/ratio_mean": 1 + O.RATIO_DRIFT * 0.9}), FACTS) is None
    jump = O.big_step(rows(**{"doctor/weight_change": [1e-4] * 9 + [O.BIG_CHANGE]}), FACTS)
    assert jump.severity == "error" and "--lr 1e-06" in jump.fix
    assert O.big_step(rows(**{"doctor/weight_change": [1e-4] * 9 + [O.BIG_CHANGE * 0.9]}), FACTS) is None
    spike = rows(12, **{"grad/norm": [1.0] * 11 + [O.GRAD_SPIKE]})
    assert "grad/norm" in O.big_step(spike, FACTS).evidence
    assert O.big_step(rows(12, **{"grad/norm": [1.0] * 11 + [O.GRAD_SPIKE * 0.9]}), FACTS) is None
    kl = [0.01] * 7 + [O.KL_HIGH * 0.5] * 4 + [O.KL_HIGH]  # 4x or more in WINDOW steps, and over KL_HIGH
    assert "loss/kl" in O.big_step(rows(12, **{"loss/kl": kl}), FACTS).evidence
    skipped = O.big_step(rows(**{"loss/skipped_updates": [0] * 9 + [1]}), FACTS)
    assert skipped.severity == "error" and "non-finite" in skipped.evidence
    assert "--mu 1" in O.big_step(rows(**{"loss/clip_frac": 0.3}), RunFacts(mu=4)).fix


def test_entropy_against_the_runs_own_start():
    collapse = [0.5, 0.5] + [0.5 * O.ENTROPY_COLLAPSE] * 8
    early = O.entropy(rows(**{"policy/entropy": collapse}), FACTS)
    assert early.severity == "warning" and "before it learned" in early.title
    rose = {"reward/mean": [0.2] * 5 + [0.6] * 5, "reward/std": 0.4}  # up by one start sd: it learned, then settled
    settled = O.entropy(rows(**{"policy/entropy": collapse, **rose}), FACTS)
    assert settled.severity == "info" and "after the reward rose" in settled.title
    at_ceiling = rows(**{"policy/entropy": collapse, "reward/accuracy": R.CEILING})
    assert O.entropy(at_ceiling, FACTS) is None  # a low entropy at the reward's ceiling is what learning looks like
    assert O.entropy(rows(**{"policy/entropy": [0.5, 0.5] + [0.051] * 8}), FACTS) is None
    blow = [0.5, 0.5] + [1.5] * 8  # 3x the start, and over 1 nat
    assert "blow-up" in O.entropy(rows(**{"policy/entropy": blow}), FACTS).title
    assert O.entropy(rows(**{"policy/entropy": [0.2, 0.2] + [0.6] * 8}), FACTS) is None  # 3x but under 1 nat
    assert (
        O.entropy(rows(4, **{"policy/entropy": [0.5, 0.5, 9.0, 9.0]}), FACTS) is None
    )  # too few steps after the start


def test_sampler_mismatch_only_without_a_correction():
    assert O.sampler_mismatch(rows(**{"engine/logratio_std": O.MISMATCH_STD * 0.9}), FACTS) is None
    found = O.sampler_mismatch(rows(**{"engine/logratio_std": O.MISMATCH_STD}), FACTS)
    assert found.severity == "warning" and "sequence-truncate" in found.fix
    corrected = RunFacts(engine_correction="sequence-truncate")
    assert O.sampler_mismatch(rows(**{"engine/logratio_std": 0.2}), corrected) is None


def test_saturation_by_the_rank_the_ceiling_and_spent_groups():
    def probed(values):
        out = rows(len(values) * 3)
        for i, v in enumerate(values):
            out[3 * i + 2]["probe/eff_rank"] = v
        return out

    # early 5.0 (mean of the first two probes): the threshold is 1 + 0.5 * (5 - 1) = 3.0
    found = S.saturation(probed([5.0, 5.0, 4.0, 3.0, 3.0]), FACTS)
    assert found.severity == "info" and found.threshold == pytest.approx(3.0) and "probe/eff_rank" in found.keys
    assert S.saturation(probed([5.0, 5.0, 4.0, 3.01, 3.01]), FACTS) is None
    assert "ceiling" in S.saturation(rows(**{"reward/accuracy": R.CEILING}), FACTS).evidence
    assert S.saturation(rows(**{"reward/accuracy": R.CEILING - 0.01}), FACTS) is None


def test_reward_hacking_signs():
    rise = {"reward/mean": [0.2] * 5 + [0.8] * 5, "reward/std": 0.3}
    length = T.reward_hacking(rows(**rise, **{"completion/len_mean": [20.0] * 5 + [30.0] * 5}), FACTS)
    assert "completion/len_mean 20.0 -> 30.0" in length.evidence
    assert T.reward_hacking(rows(**rise, **{"completion/len_mean": [20.0] * 5 + [29.0] * 5}), FACTS) is None
    evals = [{"step": 0, "eval/accuracy_greedy": 0.5, "eval/accuracy_greedy_lo": 0.4, "eval/accuracy_greedy_hi": 0.6}]
    flat = evals + rows(**rise) + [{"step": 10, "eval/accuracy_greedy": 0.5}]
    assert "eval/accuracy_greedy went 0.500 -> 0.500" in T.reward_hacking(flat, FACTS).evidence
    up = evals + rows(**rise) + [{"step": 10, "eval/accuracy_greedy": 0.61}]
    assert T.reward_hacking(up, FACTS) is None  # the held-out accuracy rose beyond its interval: no hacking
    # greedy flat but sampled (what the training reward measures) up, as in the demo: the reward and the task agree
    sampled = {"eval/accuracy_sampled": 0.2, "eval/accuracy_sampled_lo": 0.18, "eval/accuracy_sampled_hi": 0.22}
    both = [
        {**evals[0], **sampled},
        *rows(**rise),
        {"step": 10, "eval/accuracy_greedy": 0.5, "eval/accuracy_sampled": 0.4},
    ]
    assert T.reward_hacking(both, FACTS) is None
    down = [
        {**evals[0], **sampled},
        *rows(**rise),
        {"step": 10, "eval/accuracy_greedy": 0.55, "eval/accuracy_sampled": 0.2},
    ]
    assert "eval/accuracy_sampled went 0.200 -> 0.200" in T.reward_hacking(down, FACTS).evidence
    # the components' names are the run's own reward/<name> keys, made unique as the rewarder makes them
    named = RunFacts.of({"reward_fn": ["a.py:length", "b.py:length", "c:accuracy"], "reward_weights": [1, 1, 1]})
    assert named.components == ("length_2", "accuracy_2") and named.reward_weights == (1, 1, 1)
    facts = RunFacts(components=("length",), reward_weights=(1.0, 0.5))
    carried = rows(**rise, **{"reward/length": [0.0] * 5 + [1.0] * 5, "reward/accuracy": 0.5})
    assert "reward/length carries 83%" in T.reward_hacking(carried, facts).evidence
    same = [{"step": 10, "prompt": p, "completion": "x"} for p in range(4) for _ in range(4)]
    assert "identical completions" in T.reward_hacking(rows(**rise), FACTS, same).evidence
    assert T.identical_groups(same[:8] + [{"step": 10, "prompt": 2, "completion": c} for c in "abcd"]) == (10, 2 / 3)


def test_the_held_out_accuracy_fell():
    first = {"step": 0, "eval/accuracy_greedy": 0.5, "eval/accuracy_greedy_lo": 0.4, "eval/accuracy_greedy_hi": 0.6}
    last = {"step": 10, "eval/accuracy_greedy": 0.3, "eval/accuracy_greedy_lo": 0.2, "eval/accuracy_greedy_hi": 0.39}
    assert T.eval_drop([first, *rows(), last], FACTS).severity == "warning"
    assert T.eval_drop([first, *rows(), {**last, "eval/accuracy_greedy_hi": 0.4}], FACTS) is None
    sampled = {"eval/accuracy_sampled": 0.3, "eval/accuracy_sampled_lo": 0.25, "eval/accuracy_sampled_hi": 0.35}
    fell = {
        "step": 10,
        "eval/accuracy_sampled": 0.2,
        "eval/accuracy_sampled_lo": 0.15,
        "eval/accuracy_sampled_hi": 0.24,
    }
    assert "eval/accuracy_sampled 0.300" in T.eval_drop([{**first, **sampled}, *rows(), fell], FACTS).evidence


def test_a_finding_says_when_it_was_found_and_until_when():
    """Replayed: first found at one check, last at another, and whether the last check still found it (the page and
    the console say "found at steps 5-10, not at the last check", not only the first step beside later evidence)."""
    n = 20
    cut = [0.5] * 10 + [0.0] * (n - 10)  # cut completions for 10 steps, then none
    found = {f.name: f for f in replay(rows(n, **{"completion/truncated_frac": cut}), FACTS, every=5)}
    t = found["truncation"]
    assert (t.first_step, t.last_step, t.ongoing) == (5, 10, False)
    assert t.when() == "found at steps 5-10, not at the last check"
    still = {f.name: f for f in replay(rows(n, **{"completion/truncated_frac": 0.5}), FACTS, every=5)}["truncation"]
    assert still.when() == "found at step 5" and still.last_step == 20
    assert Finding("x", "info", "t", "e", "c", ("k",), (1, 2)).when() == ""  # not replayed: nothing to say


def test_causes_come_before_what_they_explain():
    # cut completions give every rollout 0: truncation, then the reward that sees no answer, then no signal
    cut = rows(**{"completion/truncated_frac": 1.0, "reward/format": 0.0, "reward/accuracy": 0.0, "reward/std": 0.0})
    assert names(diagnose(cut, FACTS)) == ["truncation", "reward_blind", "no_signal"]
    # a warning that explains an error is listed as one, first
    mild = rows(**{"completion/truncated_frac": 0.3, "reward/format": 0.0, "reward/accuracy": 0.0})
    found = diagnose(mild, FACTS)
    assert names(found)[:2] == ["truncation", "reward_blind"] and found[0].severity == "warning"
    assert C.explained(found[0], found) == ["reward_blind", "no_signal"]
    # a cause found after its effect does not explain it
    late = [Finding("big_step", "warning", "", "", "", (), (1, 1), first_step=10),
            Finding("no_signal", "error", "", "", "", (), (1, 1), first_step=5)]  # fmt: skip
    assert names(C.order(late)) == ["no_signal", "big_step"]


def test_replay_finds_what_each_check_step_found():
    cut = [0.0] * 5 + [0.9] * 5 + [0.0] * 10  # truncated for five steps in the middle of the run
    found = replay(rows(20, **{"completion/truncated_frac": cut}), FACTS, every=5)
    assert [(f.name, f.first_step, f.ongoing) for f in found] == [("truncation", 10, False)]


# ---------------------------------------------------------------- each fault on a short built-in run


FAULTS = {
    "no_signal": dict(reward_fn=("reward_fixtures:always_one",)),
    "truncation": dict(max_new_tokens=2),
    "reward_blind": dict(reward_fn=("reward_fixtures:strict_answer_tag",)),
    "no_movement": dict(lr=1e-9),
    "rounding": dict(precision="bf16-true", compensation="none"),  # plain AdamW on bf16 weights
    "big_step": dict(lr=1e-1, mu=4),
    "reward_hacking": dict(reward_fn=("reward_fixtures:pays_for_length",), steps=15, eval_every=5, lr=1e-3),
    "sampler_mismatch": dict(rollout_dtype="bfloat16", engine_correction="none"),
    "entropy": dict(entropy_coef=1.0, lr=1e-3, steps=12),
    # mostly_one pays on any completion, the honeypots' too: that sign would rightly name reward_hacking first
    "saturation": dict(reward_fn=("reward_fixtures:mostly_one",), group_size=8, honeypots="none"),
}


# the runs in bf16 are the machine's business: they run on a CPU with bf16 units or without, each as it is
BF16_FAULTS = ("rounding", "sampler_mismatch")


@pytest.mark.slow  # a run of 6-15 steps each: 2-6 s, 38 of the fast tier's 93 worker-seconds when they were in it
@pytest.mark.parametrize(
    "fault", [pytest.param(f, marks=pytest.mark.hardware) if f in BF16_FAULTS else f for f in FAULTS]
)
def test_each_fault_is_named_first(fault, tmp_path):
    from grpolab.training.recipe import train

    options = {"steps": 8, "warmup_steps": 0, "log_rollouts": True, **FAULTS[fault]}
    out = train(small_cfg(tmp_path / fault, **options), log=quiet)
    run, found = examine(out)
    assert found and found[0].name == fault, format_findings(run, found, 5)
    assert [f["name"] for f in grpolab.diagnose(out)] == names(found)  # the Python API gives the same
    assert found[0].first_step <= 15
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get(f"doctor/{fault}", 0) > 0 for r in logged)  # the run's own checks found it too


@pytest.mark.slow  # 15 steps with 3 evaluations: 3 s
def test_a_healthy_builtin_run_finds_nothing_and_says_so(tmp_path, capsys):
    from grpolab.training.recipe import train

    lines: list[str] = []
    out = train(small_cfg(tmp_path / "ok", steps=15, eval_every=5, warmup_steps=0), log=lines.append)
    assert not [line for line in lines if line.startswith("doctor")]
    res = run_cli(["doctor", str(out)], cwd=tmp_path)
    assert res.returncode == 0 and "no problems found" in res.stdout and "training reward" in res.stdout
    data = json.loads(run_cli(["doctor", str(out), "--json"], cwd=tmp_path).stdout)
    assert data["healthy"] and data["findings"] == []
    assert grpolab.diagnose(out) == []


def test_the_watcher_says_a_new_condition_once_and_doctor_off_is_silent(tmp_path):
    from grpolab.training.recipe import train

    lines: list[str] = []
    out = train(small_cfg(tmp_path / "cut", steps=12, max_new_tokens=2, eval_every=0), log=lines.append)
    said = [line for line in lines if line.startswith("doctor")]
    assert sum("Truncation" in line for line in said) == 1
    assert said[0] == (
        "doctor [error] step 5: Truncation: 100% of completions stop at --max-new-tokens 2; change: --max-new-tokens 8"
    )
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    checked = [r["step"] for r in logged if "doctor/truncation" in r]
    assert checked == [5, 10] and all(r["doctor/truncation"] == 3 for r in logged if "doctor/truncation" in r)
    assert all("doctor/weight_change" in r for r in logged if r["step"] > 0)
    lines.clear()
    off = train(small_cfg(tmp_path / "off", steps=6, max_new_tokens=2, doctor="off", eval_every=0), log=lines.append)
    assert not [line for line in lines if line.startswith("doctor")]
    assert not any(k.startswith("doctor/") for line in (off / "metrics.jsonl").read_text().splitlines() for k in json.loads(line))  # fmt: skip


def test_a_check_that_fails_never_stops_the_run(monkeypatch):
    import grpolab.doctor.examine as examine_module

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in a check")

    monkeypatch.setattr(examine_module, "diagnose", broken)
    said: list[str] = []
    watcher = Watcher({}, every=1, log=said.append)
    assert watcher.check(1, rows(1)[0]) == {} and watcher.check(2, rows(1)[0]) == {}
    assert len(said) == 1 and "a bug in a check" in said[0] and "training goes on" in said[0]


def test_a_resumed_run_does_not_repeat_what_it_said(tmp_path):
    logged = [{**r, "doctor/truncation": 3} for r in rows(5, **{"completion/truncated_frac": 1.0})]
    said: list[str] = []
    watcher = Watcher({"max_new_tokens": 2}, every=5, rows=logged, log=said.append)
    levels = watcher.check(10, rows(10, **{"completion/truncated_frac": 1.0})[-1])
    assert levels["doctor/truncation"] == 3 and said == []


# ---------------------------------------------------------------- recorded real runs


def test_a_smollm2_run_that_learns_raises_nothing_above_info_and_sees_saturation_ahead():
    from grpolab.probes.signals import saturation_step, series

    run, found = examine(FIXTURES / "smollm2-last-letter")  # 48 steps, held-out greedy 0.18 -> 0.89
    assert all(f.severity == "info" for f in found), format_findings(run, found, 5)
    saturation = next(f for f in found if f.name == "saturation")
    plateau = saturation_step(series(run.rows, "eval/accuracy_greedy"))  # docs/foundations.md's rule
    assert saturation.first_step == 15 and plateau == 36  # the warning 21 steps ahead of the plateau


def test_smollm2_at_32_tokens_is_told_truncation_at_the_first_check():
    run, found = examine(FIXTURES / "smollm2-word-problems-32")
    first = found[0]
    assert first.name == "truncation" and first.first_step == 5, format_findings(run, found, 5)
    assert "--max-new-tokens 128" in first.fix


def test_the_demos_first_20_steps_raise_nothing_above_info():
    """The demo's first FLAT_STEPS (20) steps, the fewest at which every check can speak (not_learning waits for 20
    training steps; the rest for at most 2 x WINDOW = 11 or two evaluations: steps 0 and 20), replayed at each
    check step: nothing above info. The run is recorded (``grpolab train --steps 20``, the demo's settings, on a
    CPU with bf16 units): two evaluations of 500 questions made the run 40 s of the suite; what the trainer learns
    on the demo is held by the runs that train it (e2e/test_trainer_smoke.py, report/test_report.py)."""
    from grpolab.doctor.optimisation import FLAT_STEPS

    run, found = examine(FIXTURES / "builtin-demo-20")
    assert [r["step"] for r in run.rows][-1] == FLAT_STEPS and run.config["steps"] == FLAT_STEPS
    assert all(f.severity == "info" for f in found), [(f.name, f.evidence) for f in found]


def test_the_report_opens_with_the_findings_each_linked_to_its_plot(tmp_path):
    from grpolab.report.page import build_report
    from grpolab.training.recipe import train

    out = train(small_cfg(tmp_path / "cut", steps=6, max_new_tokens=2, eval_every=0), log=quiet)
    page = build_report(out).read_text()
    found = examine(out)[1]
    assert page.index('id="doctor"') < page.index('id="eval"')
    for f in found:  # each finding links to its own figure on the page
        assert f'href="#doctor-{f.name}"' in page and f'<figure id="doctor-{f.name}">' in page
    assert page.index("Truncation: 100%") < page.index("The reward never sees an answer")


def test_a_run_cut_mid_line_is_read_and_a_missing_one_is_one_error(tmp_path):
    run = tmp_path / "cut"
    run.mkdir()
    lines = [json.dumps(r) for r in rows(10, **{"completion/truncated_frac": 1.0})]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 11, "reward/me')  # killed while writing
    (run / "config.json").write_text(json.dumps({"max_new_tokens": 16}))
    assert [f.name for f in examine(run)[1]][0] == "truncation"
    res = run_cli(["doctor", str(tmp_path / "nothing")], cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip().endswith("not a run directory (no metrics.jsonl)")


def test_the_remaining_thresholds_at_their_edges():
    import statistics

    from grpolab.doctor.rows import RISE_SD, learned

    # RISE_SD: the reward has risen by half the start's rollout spread
    rise = {"reward/std": 0.5, "reward/mean": [0.25] * 5 + [0.25 + RISE_SD * 0.5] * 5}
    assert learned(rows(**rise)) and not learned(rows(**{**rise, "reward/mean": [0.25] * 5 + [0.49] * 5}))
    # CONSTANT_STD: a reward with less spread than float rounding is constant
    flat = {"reward/frac_zero_std": 1.0, "reward/mean": 0.3}
    assert "same reward" in S.no_signal(rows(**flat, **{"reward/std": S.CONSTANT_STD / 2}), FACTS).title
    assert "same reward" not in S.no_signal(rows(**flat, **{"reward/std": S.CONSTANT_STD}), FACTS).title
    # HACK_RISE_SD: a training reward up by one start sd while the held-out accuracy does not move
    evals = [{"step": 0, "eval/accuracy_greedy": 0.5}], [{"step": 10, "eval/accuracy_greedy": 0.5}]
    up = {"reward/std": 0.25, "reward/mean": [0.25] * 5 + [0.25 + T.HACK_RISE_SD * 0.25] * 5}
    assert T.reward_hacking([*evals[0], *rows(**up), *evals[1]], FACTS) is not None
    under = {**up, "reward/mean": [0.25] * 5 + [0.49] * 5}
    assert T.reward_hacking([*evals[0], *rows(**under), *evals[1]], FACTS) is None
    # LENGTH_CORR: length 1.5x with the reward, correlated at least 0.8 (the reward risen and nothing else)
    length = [20.0] * 5 + [30.0] * 5
    for noise in (0.05, 0.3):
        reward = [0.2 + 0.03 * (x - 20) + (noise if i % 2 else -noise) for i, x in enumerate(length)]
        corr = statistics.correlation(length, reward)
        found = T.reward_hacking(
            rows(**{"completion/len_mean": length, "reward/mean": reward, "reward/std": 0.3}), FACTS
        )
        assert (found is not None) == (corr >= T.LENGTH_CORR), (noise, corr)
    # COMPONENT_SHARE: one weighted component carrying 0.8 of the reward's rise, the first reward flat
    facts = RunFacts(components=("length",), reward_weights=(1.0, 1.0))
    total = {"reward/mean": [0.25] * 5 + [0.75] * 5, "reward/std": 1.0}  # rise 0.5, under RISE_SD: no other sign
    carried = T.reward_hacking(rows(**total, **{"reward/length": [0.0] * 5 + [T.COMPONENT_SHARE * 0.5] * 5}), facts)
    assert "reward/length carries 80%" in carried.evidence
    assert T.reward_hacking(rows(**total, **{"reward/length": [0.0] * 5 + [0.39] * 5}), facts) is None
    # IDENTICAL_SHARE: half of the last step's groups with one completion each (after the reward rose)
    same = [{"step": 10, "prompt": p, "completion": "x" if p < 2 else f"x{g}"} for p in range(4) for g in range(4)]
    assert "50% of step 10's groups" in T.reward_hacking(rows(**rise), FACTS, same).evidence
    fewer = [{**r, "completion": f"x{i}"} if r["prompt"] == 1 else r for i, r in enumerate(same)]
    assert T.reward_hacking(rows(**rise), FACTS, fewer) is None
    # KL_GROWTH: KL over KL_HIGH and KL_GROWTH times what it was WINDOW steps before
    kl = [O.KL_HIGH / O.KL_GROWTH] * 7 + [O.KL_HIGH / 2] * 4 + [O.KL_HIGH]
    assert "loss/kl" in O.big_step(rows(12, **{"loss/kl": kl}), FACTS).evidence
    slower = [O.KL_HIGH / 3.9] * 7 + [O.KL_HIGH / 2] * 4 + [O.KL_HIGH]
    assert O.big_step(rows(12, **{"loss/kl": slower}), FACTS) is None
