"""The run's signals read (grpolab.probes.signals) against hand-worked values, and the report's signal panel."""

from __future__ import annotations

import math

import pytest
import torch

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
                "probe/g_star": g,
                **({"eval/accuracy_greedy": a} if a is not None else {}),
            }
            for s, r, sd, z, g, a in [
                (5, 4.0, 0.45, 0.1, 3.2, 0.5),
                (10, 1.9, 0.3, 0.4, None, 0.75),  # sigma_P^2 <= 0: no G* (the panel skips the step)
                (15, 1.5, 0.2, 0.6, 5.46, 0.8),
            ]
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
    assert lines[3] == (
        "G* 5.5 at step 15 (3.2 at step 5): groups of about that size would give the least gradient error for the "
        "rollouts a step draws [U-statistic, Thm 7]"
    )
    assert lines[4] == "saturation at step 10: greedy held-out accuracy reached 90% of its gain over the run"


def test_the_report_panel_draws_the_signals_only_for_a_probed_run():
    html = signal_panel(_rows())
    assert html.startswith('<img alt="signals over training" src="data:image/png;base64,') and html.count("<li>") == 5
    assert signal_panel([{"step": 1, "reward/frac_zero_std": 0.5}]) == ""


# ---------------------------------------------------------------- G* online


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_the_online_g_star_is_groupsizes_estimate_on_the_steps_first_groups(tmp_path, aggregation):
    """probe/g_star against the same estimate formed from explicit per-rollout gradients (one backward per rollout,
    float64 model) of the update's first 3 groups: the plain scores' Gram matrices, each group's leave-one-out
    gradient sum_i (r_i - mean_{j != i} r_j) g_i / G, their cross products. Under seq-mean-token-mean the probe
    takes a Gram pass of plain scores; under Dr. GRPO's (weight 1/max_len) it rescales the spectrum's."""
    from helpers.runs import small_cfg

    from grpolab.algo.groups import offsets
    from grpolab.common.batch import select
    from grpolab.models.logprobs import completion_logprobs
    from grpolab.probes.mse import groupsize_constants, optimal_group_size, prompt_moments
    from grpolab.training.recipe import build_trainer
    from grpolab.training.step import StepObserver

    cfg = small_cfg(tmp_path / "run", prompts_per_step=4, group_size=4, probe_every=1, probe_groups=3, seed=0,
                    dtype="float64", aggregation=aggregation)  # fmt: skip
    trainer = build_trainer(cfg)
    model, found = trainer.policy.model, {}

    class Explicit(StepObserver):
        def before_update(self, result):
            roll, rows = result.collected, result.collected.groups.rows
            starts = offsets(roll.groups.sizes)
            params = [p for p in model.parameters() if p.requires_grad]
            moments, loo = {}, {}
            for k, b in enumerate(roll.groups.prompt):
                pos = roll.positions[b]
                if pos >= 3:
                    continue
                grads = []
                for i in rows.rows_of(list(range(starts[k], starts[k + 1]))):
                    one = select(rows.batch, torch.tensor([i]))
                    logp = completion_logprobs(model, one, cfg.generation.temperature)
                    g = torch.autograd.grad((logp * one.completion_mask).sum(), params, allow_unused=True)
                    grads.append(torch.cat([(x if x is not None else torch.zeros_like(p)).reshape(-1)
                                            for x, p in zip(g, params)]))  # fmt: skip
                g = torch.stack(grads).double()  # [G, D]
                r = torch.tensor(roll.rewards[pos], dtype=torch.float64)
                n = len(r)
                moments[pos] = prompt_moments(g @ g.T, r)
                loo[pos] = ((r - (r.sum() - r) / (n - 1)) / n) @ g
            V = torch.stack([loo[p] for p in sorted(loo)])
            found["varied"] = sum(float(torch.tensor(result.collected.rewards[p]).std()) > 0 for p in sorted(loo))
            found["g_star"] = optimal_group_size(groupsize_constants([moments[p] for p in sorted(moments)], V @ V.T))

    trainer.observers.append(Explicit())
    out = trainer.step(1)
    assert found["varied"] >= 2, "the comparison needs groups with reward variance"
    assert math.isfinite(found["g_star"]) and found["g_star"] > 1
    assert out.metrics["probe/g_star"] == pytest.approx(found["g_star"], rel=1e-5)


def test_no_probe_g_star_leaves_the_spectrum_as_it_was(tmp_path):
    """--no-probe-g-star: no probe/g_star, and every other probe metric the same as with it."""
    from helpers.runs import small_cfg

    from grpolab.training.recipe import build_trainer

    rows = []
    for g_star in (True, False):
        cfg = small_cfg(tmp_path / f"run{g_star}", probe_every=1, probe_groups=3, seed=0, probe_g_star=g_star)
        rows.append(build_trainer(cfg).step(1).metrics)
    assert "probe/g_star" in rows[0] and "probe/g_star" not in rows[1]
    probe = [k for k in rows[1] if k.startswith("probe/")]
    assert len(probe) > 5 and all(rows[0][k] == rows[1][k] for k in probe)
