"""--sampling fixed|filter|adaptive: the allocation rule, and the trainer's use of it."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpolab.algo.advantages import compute_advantages, ragged_advantages
from grpolab.algo.group_budget import (
    RankControl,
    allocate_group_sizes,
    next_round_size,
    prompt_weights,
    rank_control,
    sample_variance,
)
from grpolab.algo.groups import has_variance
from grpolab.config.train import ConfigError, TrainConfig
from grpolab.probes.advantage_stats import advantage_stats
from grpolab.training.recipe import train
from grpolab.training.runlog import read_metrics

# ---------------------------------------------------------------- the allocation rule


def _objective(pilots, sizes):
    return sum(sample_variance(p) / (n - 1) for p, n in zip(pilots, sizes))


def _brute_force(pilots, budget, cap):
    """Every allocation, by enumeration: the least sum V / (n - 1) (the module docstring's objective)."""
    n0 = [len(p) for p in pilots]
    best = None
    for extra in itertools.product(*(range(cap - n + 1) for n in n0)):
        if sum(n0) + sum(extra) != budget:
            continue
        sizes = [n + e for n, e in zip(n0, extra)]
        value = _objective(pilots, sizes)
        if best is None or value < best[0] - 1e-12:
            best = (value, sizes)
    return best


def test_the_rank_control_rule_on_a_scripted_signal():
    """Budget 64, min 2 prompts, patience 6, a probe every 3 steps: the group size doubles when the rank has fallen to
    half of its first value at that size, takes a new reference after each change, and stops at 64 // 2 = 32."""
    ranks = {3: 5.0, 6: None, 9: 4.8, 12: 2.6, 15: 2.5, 18: 3.0, 21: 1.6, 24: 1.4, 27: 1.0, 30: 0.6, 33: 0.2}
    state, sizes = RankControl(8), {}
    for step in range(1, 37):
        state = rank_control(state, step, ranks.get(step), budget=64, min_prompts=2, patience=6)
        sizes[step] = state.group_size
        assert 64 % state.group_size == 0 and 64 // state.group_size >= 2  # B G = the budget, at least 2 prompts
    # 5.0 is the reference; 2.5 at step 15 is half of it: 16 from step 15; 3.0 the new reference; 1.4 at step 24 is
    # under 1.5 but 9 >= 6 steps after: 32 from step 24; 1.0, then 0.2: no room beyond 32
    assert [sizes[s] for s in (3, 12, 14, 15, 23, 24, 36)] == [8, 8, 8, 16, 16, 32, 32]
    assert rank_control(RankControl(8, 5.0, 10), 12, 1.0, 64, 2, 6) == RankControl(8, 5.0, 10)  # within patience
    assert rank_control(RankControl(8, 5.0), 12, 1.0, 48, 2, 6).group_size == 16  # 48 = 3 x 16
    assert rank_control(RankControl(16, 5.0), 12, 1.0, 48, 2, 6).group_size == 16  # 32 does not divide 48


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_the_exact_integer_optimum(seed):
    g = torch.Generator().manual_seed(seed)
    pilots = [torch.bernoulli(torch.full((3,), float(p)), generator=g).tolist() for p in torch.rand(4, generator=g)]
    pilots[0] = [0.0, 1.0, 1.0]  # at least one with variance, so the rule (not the even fallback) decides
    budget, cap = 4 * 3 + 9, 9
    sizes = allocate_group_sizes(pilots, budget, cap)
    assert sum(sizes) == budget and all(3 <= n <= cap for n in sizes)
    best_value, _ = _brute_force(pilots, budget, cap)
    assert _objective(pilots, sizes) == pytest.approx(best_value, abs=1e-12)


def test_zero_variance_pilots_get_nothing_while_others_can_take_it():
    pilots = [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0]]
    sizes = allocate_group_sizes(pilots, 32, 32)
    assert sizes[0] == sizes[2] == 4
    assert sum(sizes) == 32
    # Neyman on n - 1: (n - 1) ~ sqrt(V); V = 1/4 and 1/3 (unbiased, n0 = 4)
    assert sizes[3] > sizes[1]
    ratio = (sizes[3] - 1) / (sizes[1] - 1)
    assert ratio == pytest.approx((1 / 3) ** 0.5 / (1 / 4) ** 0.5, rel=0.1)


def test_left_over_budget_is_spread_evenly():
    # none varies: the budget is still spent, evenly, fewest first, lowest index on ties
    assert allocate_group_sizes([[0, 0], [1, 1], [0, 0]], 6 + 4, 16) == [4, 3, 3]
    # the only varying prompt hits its cap; the rest goes evenly to the others
    assert allocate_group_sizes([[0, 1], [1, 1], [0, 0]], 6 + 10, 6) == [6, 5, 5]


def test_allocation_refuses_impossible_budgets():
    with pytest.raises(ValueError, match="exceed"):
        allocate_group_sizes([[0, 1], [0, 1]], 3, 8)
    with pytest.raises(ValueError, match="does not fit"):
        allocate_group_sizes([[0, 1], [0, 1]], 20, 8)


def test_prompt_weights_are_one_for_equal_groups_and_give_each_prompt_1_over_B():
    assert prompt_weights([8, 8, 8]) == [1.0, 1.0, 1.0]
    sizes = [2, 6, 16]
    w = prompt_weights(sizes)
    N = sum(sizes)
    assert [wi * n / N for wi, n in zip(w, sizes)] == pytest.approx([1 / 3] * 3)  # each prompt's share of the mean


def test_next_round_draws_what_the_keep_rate_says_is_missing():
    assert next_round_size(16, 16, 16) == 0
    assert next_round_size(16, 0, 16) == 16  # nothing kept yet: a full round
    assert next_round_size(16, 12, 16) == 6  # 4 missing at a keep rate of 3/4
    assert next_round_size(16, 2, 16) == 16  # capped at B
    assert next_round_size(16, 15, 16) >= 1


def test_has_variance():
    r = torch.tensor([[0.0, 0, 0], [0, 1, 0], [0.5, 0.5, 0.5]])
    assert has_variance(r).tolist() == [False, True, False]


def test_ragged_advantages_match_each_group_alone():
    groups = [torch.tensor([1.0, 0, 0]), torch.tensor([0.0, 1, 1, 1, 0]), torch.tensor([1.0, 1])]
    for est in ("grpo", "grpo_std", "rloo", "vanilla"):
        out = ragged_advantages(groups, est)
        want = torch.cat([compute_advantages(g[None], est)[0] for g in groups])
        assert torch.equal(out, want)
    same = [torch.tensor([1.0, 0, 0, 1]), torch.tensor([0.0, 0, 1, 1])]
    assert torch.equal(ragged_advantages(same, "rloo"), compute_advantages(torch.stack(same), "rloo").reshape(-1))


def test_ragged_advantage_stats_pool_each_groups_own_theory():
    groups = [
        torch.tensor([1.0, 0, 0, 1, 1, 0]),
        torch.tensor([0.0, 1]),
        torch.tensor([0.0, 0, 0]),
        torch.tensor([1.0, 0, 0]),
    ]
    st = advantage_stats(groups, eps=0.2)
    # by hand: A = r - mean per group; Var theory per rollout (R-1)/R s^2; pairs weight the covariance
    A = [g - g.mean() for g in groups]
    R = [len(g) for g in groups]
    s2 = [float(g.var()) for g in groups]
    N = sum(R)
    assert st["var_emp"] == pytest.approx(sum(float((a**2).sum()) for a in A) / N)
    assert st["var_theory"] == pytest.approx(sum((r - 1) * v for r, v in zip(R, s2)) / N)
    pairs = sum(r * (r - 1) for r in R)
    assert st["cov_emp"] == pytest.approx(sum(float(a.sum() ** 2 - (a**2).sum()) for a in A) / pairs)
    assert st["cov_theory"] == pytest.approx(-sum((r - 1) * v for r, v in zip(R, s2)) / pairs)
    assert st["frac_zero_var"] == pytest.approx(1 / 4)
    assert st["max_abs_group_sum"] < 1e-6
    # equal sizes as a list: exactly the [B, R] statistics
    eq = [torch.tensor([1.0, 0, 0]), torch.tensor([0.0, 1, 1])]
    assert advantage_stats(eq) == advantage_stats(torch.stack(eq))


@pytest.mark.parametrize(
    "over, field",
    [
        (dict(sampling="greedy"), "sampling"),
        (dict(sampling="adaptive", pilot_size=8), "pilot_size"),
        (dict(sampling="adaptive", pilot_size=1), "pilot_size"),
        (dict(sampling="filter", estimator="vanilla"), "sampling"),
        (dict(sampling="adaptive", max_group_size=4), "max_group_size"),
        (dict(max_sampling_rounds=0), "max_sampling_rounds"),
    ],
)
def test_invalid_sampling_configs_name_the_field(over, field):
    with pytest.raises(ConfigError, match=field.replace("_", "[-_]")):
        TrainConfig(**over).validate()


# ---------------------------------------------------------------- the trainer

SMALL = dict(
    model="builtin",
    prompts_per_step=4,
    group_size=4,
    eval_questions=16,
    eval_samples=1,
    max_new_tokens=48,
    progress=False,
    threads=1,
    device="cpu",
    warmup_steps=0,
    lr=1e-3,
    log_rollouts=True,
    reward_fn="reward_fixtures:code_sum_mod4",
    format_weight=0.0,
    hacking_every=0,  # the hacking signs off, as in helpers.runs.SMALL
    honeypots="none",
)


def _quiet(*a, **k):
    pass


def _groups(run: Path) -> dict[int, dict[int, list[dict]]]:
    """step -> prompt -> its rollouts (in rollout order), from rollouts.jsonl."""
    out: dict[int, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for line in (run / "rollouts.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]][r["prompt"]].append(r)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sampling")
    return {
        "fixed": train(TrainConfig(out=str(tmp / "fixed"), steps=2, **SMALL), log=_quiet),
        "filter": train(TrainConfig(out=str(tmp / "filter"), steps=3, sampling="filter", **SMALL), log=_quiet),
        "filter1": train(
            TrainConfig(out=str(tmp / "filter1"), steps=3, sampling="filter", max_sampling_rounds=1, **SMALL),
            log=_quiet,
        ),
        "adaptive": train(
            TrainConfig(out=str(tmp / "adaptive"), steps=3, sampling="adaptive", pilot_size=2, probe_every=1, **SMALL),
            log=_quiet,
        ),
    }


@pytest.mark.slow
def test_filter_updates_only_on_groups_with_reward_variance(runs):
    rows = {r["step"]: r for r in read_metrics(runs["filter"] / "metrics.jsonl")}
    groups = _groups(runs["filter"])
    assert any(rows[s]["sampling/rounds"] > 1 for s in (1, 2, 3)), "the test needs steps that drew more than one round"
    for step in (1, 2, 3):
        row = rows[step]
        assert row["sampling/short"] == 0 and row["sampling/kept_groups"] == 4 == len(groups[step])
        for prompt, rollouts in groups[step].items():
            assert len({r["reward"] for r in rollouts}) > 1, (step, prompt)
        assert row["reward/frac_zero_std"] == 0.0
        assert row["sampling/rollouts"] >= 16 and row["sampling/rollouts"] % 4 == 0
    assert rows[3]["sampling/rollouts_total"] == sum(rows[s]["sampling/rollouts"] for s in (1, 2, 3))


@pytest.mark.slow
def test_filter_short_of_B_trains_on_the_kept_groups_and_counts_it(runs):
    rows = {r["step"]: r for r in read_metrics(runs["filter1"] / "metrics.jsonl")}
    groups = _groups(runs["filter1"])
    short = [s for s in (1, 2, 3) if rows[s]["sampling/short"]]
    assert short, "with one round and a quarter pass rate some step must fall short"
    for step in short:
        assert rows[step]["sampling/kept_groups"] == len(groups[step]) < 4
        assert rows[step]["sampling/rollouts"] == 16  # one round only
        assert all(len({r["reward"] for r in g}) > 1 for g in groups[step].values())


@pytest.mark.slow
def test_adaptive_spends_the_budget_and_gives_zero_variance_pilots_nothing(runs):
    rows = {r["step"]: r for r in read_metrics(runs["adaptive"] / "metrics.jsonl")}
    groups = _groups(runs["adaptive"])
    n0, cap = 2, 16
    uneven = False
    for step in (1, 2, 3):
        sizes = {b: len(g) for b, g in groups[step].items()}
        assert rows[step]["sampling/rollouts"] == sum(sizes.values()) == 16
        assert rows[step]["sampling/group_size_max"] == max(sizes.values())
        pilot_varies = {b: len({r["reward"] for r in g[:n0]}) > 1 for b, g in groups[step].items()}
        room = any(pilot_varies[b] and sizes[b] < cap for b in sizes)
        for b, n in sizes.items():
            assert n >= n0
            if not pilot_varies[b] and any(pilot_varies.values()) and room:
                assert n == n0, (step, b, sizes)
        uneven |= len(set(sizes.values())) > 1
    assert uneven, "the test needs a step whose groups differ in size"
    # the probes run on groups of different sizes: advantage statistics pooled over them, spectra per group
    assert all(rows[s]["probe/adv_max_abs_group_sum"] < 1e-5 for s in (1, 2, 3))
    assert all(rows[s]["probe/adv_var_emp"] == pytest.approx(rows[s]["probe/adv_var_theory"]) for s in (1, 2, 3))
    measured = [rows[s] for s in (1, 2, 3) if rows[s]["probe/groups_measured"]]
    assert measured and all(1 <= r["probe/eff_rank"] for r in measured)


@pytest.mark.slow
def test_adaptive_rollouts_are_those_fixed_would_draw(runs):
    """Rollout g of prompt b comes from the stream (step, b, g) in every mode: at step 1 (same weights) an
    adaptive group is the fixed group's first rollouts (and continues past them)."""
    fixed, adaptive = _groups(runs["fixed"])[1], _groups(runs["adaptive"])[1]
    for b, rollouts in adaptive.items():
        n = min(len(rollouts), 4)
        assert [r["completion"] for r in rollouts[:n]] == [r["completion"] for r in fixed[b][:n]]


@pytest.mark.slow
def test_fixed_is_what_it_always_was(runs):
    rows = read_metrics(runs["fixed"] / "metrics.jsonl")[1:]
    assert all(
        r["sampling/rollouts"] == 16 and r["sampling/rounds"] == 1 and r["sampling/group_size_max"] == 4 for r in rows
    )


def _without_time(row: dict, drop_eval: bool = False) -> dict:
    evaluation = ("eval/", "hacking/honeypot")  # the held-out questions and the honeypots drawn with them
    return {k: v for k, v in row.items() if not k.startswith("time/") and not (drop_eval and k.startswith(evaluation))}


@pytest.mark.parametrize("mode", ["filter", "adaptive"])
@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(runs, tmp_path, mode):
    extra = dict(sampling=mode, pilot_size=2, save_every=2, probe_every=1 if mode == "adaptive" else 0)
    a = runs[mode]
    b = train(TrainConfig(out=str(tmp_path / "B"), steps=2, **extra, **SMALL), log=_quiet)
    train(TrainConfig(out=str(tmp_path / "B"), steps=3, resume=True, **extra, **SMALL), log=_quiet)
    ra, rb = ({r["step"]: r for r in read_metrics(x / "metrics.jsonl")} for x in (a, b))
    assert sorted(ra) == sorted(rb) == [0, 1, 2, 3]
    for step in (1, 2, 3):  # step 2 ended B's first part, which evaluated there
        assert _without_time(rb[step], step == 2) == _without_time(ra[step], step == 2), step
    assert (a / "rollouts.jsonl").read_text() == (b / "rollouts.jsonl").read_text()
    pa, pb = (load_file(str(x / "checkpoints" / "step_3" / "model.safetensors")) for x in (a, b))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.slow
def test_max_rollouts_stops_the_run_at_the_budget(tmp_path):
    out = train(TrainConfig(out=str(tmp_path / "m"), steps=10, sampling="filter", max_rollouts=40, **SMALL), log=_quiet)
    rows = read_metrics(out / "metrics.jsonl")
    last = rows[-1]
    assert last["sampling/rollouts_total"] >= 40 > last["sampling/rollouts_total"] - last["sampling/rollouts"]
    assert "eval/accuracy_sampled" in last and (out / "checkpoints" / f"step_{last['step']}").is_dir()
    # resuming a run that has spent its budget trains no further
    train(
        TrainConfig(out=str(tmp_path / "m"), steps=10, sampling="filter", max_rollouts=40, resume=True, **SMALL),
        log=_quiet,
    )
    assert read_metrics(out / "metrics.jsonl")[-1]["step"] == last["step"]


# ---------------------------------------------------------------- the bandit check of the modes' bias


@pytest.mark.slow
def test_bandit_fixed_rloo_is_unbiased_and_filter_only_lengthens_the_step():
    """fixed + rloo: E g = grad J on every prompt (c = 1). filter: every kept group is a draw from the groups
    with variance, whose estimate has mean grad J_m / q_m (q_m = 1 - J^G - (1-J)^G: zero-variance groups give 0),
    and prompt m is kept in proportion to q_m; so E g = grad J * P(any group kept) / mean_m q_m, the same
    c for every prompt: a longer step in the true direction. A filter that normalised by the drawn groups, or
    kept zero-variance ones, would miss this c."""
    from grpolab.analysis.sampling_bias import BanditStep, measure

    rates = (0.1, 0.5, 0.8)
    step = BanditStep(B=4, G=4, pilot_size=2, max_rounds=2)
    fixed, filt = measure(("fixed", "filter"), rates, step, trials=6000, seed=3)
    for s in fixed["scale"]:
        half = (s["hi"] - s["lo"]) / 2
        assert abs(s["c"] - 1) < 2 * half, s
    q = [1 - j**4 - (1 - j) ** 4 for j in rates]
    qbar = sum(q) / len(q)
    want = (1 - (1 - qbar) ** (4 * 2)) / qbar
    assert want > 1.15  # the check has teeth: the filter's scale is far from fixed's
    for s in filt["scale"]:
        half = (s["hi"] - s["lo"]) / 2
        assert abs(s["c"] - want) < 2 * half, (s, want)
    assert filt["rollouts_per_step"] > fixed["rollouts_per_step"] == 16


@pytest.mark.slow
def test_bandit_adaptive_is_fixed_for_one_prompt_and_shrinks_extreme_prompts_otherwise():
    """One prompt a step: the whole budget goes to it whatever its pilot (to the prompt with variance, or as
    left-over), so adaptive is fixed and unbiased (c = 1). Several: a pilot whose rewards are all equal keeps
    its n0 rollouts and its estimate is 0, where fixed's further rollouts would have found the rare other
    outcome; so prompts with extreme pass rates have their gradient shrunk (c well below 1), and more than
    prompts at J = 1/2: a biased direction (docs/sampling.md)."""
    from grpolab.analysis.sampling_bias import BanditStep, measure

    rates = (0.1, 0.5, 0.9)
    (one,) = measure(("adaptive",), rates, BanditStep(B=1, G=6, pilot_size=2), trials=4000, seed=2)
    assert one["rollouts_per_step"] == 6
    for s in one["scale"]:
        assert abs(s["c"] - 1) < 2 * (s["hi"] - s["lo"]) / 2, s
    (ad,) = measure(("adaptive",), rates, BanditStep(B=4, G=6, pilot_size=2), trials=3000, seed=1)
    assert ad["rollouts_per_step"] == 24
    lo, mid, hi = ad["scale"]
    assert lo["hi"] < 0.75 and hi["hi"] < 0.75, ad["scale"]
    assert mid["lo"] > max(lo["hi"], hi["hi"]), ad["scale"]
    assert ad["cosine"] < 0.9995


def test_concat_batches_pads_prompts_left_and_completions_right():
    from grpolab.common.batch import Batch
    from grpolab.rollout.rows import concat_batches

    a = Batch(torch.tensor([[5, 6]]), torch.tensor([[1, 1]]), torch.tensor([[7]]), torch.tensor([[1]]))
    b = Batch(torch.tensor([[0, 1, 2]]), torch.tensor([[0, 1, 1]]), torch.tensor([[3, 4]]), torch.tensor([[1, 1]]))
    c = concat_batches([a, b], pad_id=0)
    assert c.prompt_ids.tolist() == [[0, 5, 6], [0, 1, 2]] and c.prompt_mask.tolist() == [[0, 1, 1], [0, 1, 1]]
    assert c.completion_ids.tolist() == [[7, 0], [3, 4]] and c.completion_mask.tolist() == [[1, 0], [1, 1]]


# ---------------------------------------------------------------- --group-size-control rank in training

CONTROL = dict(
    prompts_per_step=8, group_size=4, probe_every=1, probe_groups=2, group_size_control="rank", control_patience=1,
    control_share=0.9, eval_questions=8, eval_samples=1, save_every=5,
)  # fmt: skip


@pytest.mark.slow
def test_the_rank_controlled_run_keeps_its_budget_and_resumes_exactly(tmp_path):
    """The controller doubles G (halving B) within the step's 32 rollouts; a run stopped at step 5 and resumed gives
    the uninterrupted run's metrics, rollouts and weights (its group size and reference come back from the
    checkpoint)."""
    from helpers.runs import by_step, quiet, small_cfg, state_dict

    a = train(small_cfg(tmp_path / "A", steps=10, log_rollouts=True, **CONTROL), log=quiet)
    b = train(small_cfg(tmp_path / "B", steps=5, log_rollouts=True, **CONTROL), log=quiet)
    train(small_cfg(tmp_path / "B", steps=10, log_rollouts=True, resume=True, **CONTROL), log=quiet)
    rows_a, rows_b = by_step(read_metrics(a / "metrics.jsonl")), by_step(read_metrics(b / "metrics.jsonl"))
    sizes = [rows_a[s]["control/group_size"] for s in range(1, 11)]
    assert sizes == sorted(sizes), sizes  # only upwards
    assert all(rows_a[s]["sampling/rollouts"] == 32 for s in range(1, 11))
    assert all(rows_a[s]["sampling/group_size_mean"] == rows_a[s]["control/group_size"] for s in range(1, 11))
    # one change before the cut (its G must come back) and one after (its reference must come back): 4, 8, 16
    assert sizes[0] == 4 and sizes[4] > 4 and sizes[-1] > sizes[4], sizes
    for s in range(6, 11):
        assert {k: v for k, v in rows_b[s].items() if not k.startswith("time/")} == {
            k: v for k, v in rows_a[s].items() if not k.startswith("time/")
        }, s
    assert (a / "rollouts.jsonl").read_text() == (b / "rollouts.jsonl").read_text()
    sa, sb = state_dict(a / "checkpoints" / "step_10"), state_dict(b / "checkpoints" / "step_10")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_the_rank_control_needs_the_probe_and_fixed_sampling():
    with pytest.raises(ConfigError, match="give --probe-every N"):
        TrainConfig(group_size_control="rank").validate()
    with pytest.raises(ConfigError, match="does not combine with --sampling adaptive"):
        TrainConfig(group_size_control="rank", probe_every=1, sampling="adaptive").validate()
    with pytest.raises(ConfigError, match="--control-share"):
        TrainConfig(group_size_control="rank", probe_every=1, control_share=1.0).validate()
