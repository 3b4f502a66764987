"""Smoke tier for the gradient-spectrum probe: ``run_rank`` / ``grpolab rank`` over the shipped
built-in model and over a short run's checkpoints, and the trainer's per-step probe metrics.

Every check here is on the tiny model with a few prompts; the numerics of Psi and of the
spectrum are tested exactly in probes/test_gram.py and probes/test_spectrum.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from grpolab.analysis.rank import RankConfig, run_rank, select_steps, table1, table_by_step
from grpolab.config.train import ConfigError, TrainConfig
from grpolab.eval.runs import run_targets
from grpolab.training.recipe import train
from grpolab.training.runlog import read_metrics

PNG = b"\x89PNG\r\n\x1a\n"
PLOTS = ("rank_effective.png", "rank_top1.png", "rank_reward_std.png")
SUMMARY = ("num_rank", "effective_rank", "top1_fraction", "distinct_active")


def _quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("rank_run") / "run"
    train(
        TrainConfig(
            out=str(out),
            steps=2,
            save_every=1,
            prompts_per_step=2,
            group_size=4,
            eval_questions=8,
            eval_samples=1,
            progress=False,
        ),
        log=_quiet,
    )
    return out


@pytest.fixture(scope="module")
def builtin_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("rank_builtin")
    report = run_rank(
        RankConfig(checkpoint="builtin", group_sizes=(2, 4), prompts=3, verify=True, progress=False, out=str(out)),
        log=_quiet,
    )
    return out, report


@pytest.fixture(scope="module")
def run_report(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rank_of_run")
    report = run_rank(
        RankConfig(checkpoint=str(run_dir), group_sizes=(2, 4), prompts=3, verify=True, progress=False, out=str(out)),
        log=_quiet,
    )
    return out, report


def _check_result(res: dict):
    R = res["R"]
    assert res["max_possible_rank"] == R
    assert res["prompts"] == 3
    assert 0.0 <= res["frac_zero_var"] <= 1.0
    assert res["reward_std_mean"] >= 0.0
    for key in SUMMARY:
        assert set(res[key]) == {"mean", "lo", "hi", "std", "min", "max", "n"}
        assert res[key]["n"] == round(3 * (1 - res["frac_zero_var"]))  # the prompts with reward variance
    if res["frac_zero_var"] == 1.0:  # no prompt with reward variance: nothing to summarise
        assert all(res[k]["mean"] is None for k in SUMMARY)
    else:
        assert res["reward_std_mean"] > 0
        for key in SUMMARY:
            s = res[key]
            assert all(math.isfinite(s[f]) for f in ("mean", "std", "min", "max")), (key, s)
            assert s["min"] <= s["mean"] <= s["max"] and s["std"] >= 0
            if s["n"] >= 2:  # the normal 95% interval of the mean over prompts, from the sample std
                half = 1.959963984540054 * s["std"] * (s["n"] / (s["n"] - 1)) ** 0.5 / s["n"] ** 0.5
                assert (s["lo"], s["hi"]) == pytest.approx((s["mean"] - half, s["mean"] + half), abs=1e-9)
            else:
                assert s["lo"] is None and s["hi"] is None
        nr, er, tf = res["num_rank"], res["effective_rank"], res["top1_fraction"]
        assert nr["min"] >= 1 and float(nr["min"]).is_integer() and float(nr["max"]).is_integer()
        assert 1.0 - 1e-9 <= er["min"] and er["mean"] <= nr["max"] <= R  # 1 <= eff. rank <= num. rank <= R
        assert 1.0 / R - 1e-9 <= tf["min"] and tf["max"] <= 1.0 + 1e-9  # top-1 share between 1/R and 1
    assert res["gram_max_rel_err"] <= 1e-4
    if res["frac_zero_var"] < 1.0:  # the numerical rank never exceeds the distinct active completions
        assert res["num_rank"]["max"] <= res["distinct_active"]["max"] <= R
    assert res["gram_time_ratio"] > 0 and res["reference_time_ratio"] > 0


def _check_outputs(out, report):
    saved = json.loads((out / "rank.json").read_text())
    assert saved["results"] == json.loads(json.dumps(report["results"]))
    assert saved["config"]["group_sizes"] == [2, 4] and saved["config"]["verify"] is True
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG, name


@pytest.mark.slow
def test_rank_on_builtin_model(builtin_report):
    out, report = builtin_report
    results = report["results"]
    assert [(r["step"], r["R"]) for r in results] == [(0, 2), (0, 4)]
    assert all(r["checkpoint"] == "builtin" for r in results)
    for res in results:
        _check_result(res)
    # the warm start solves some probe questions and not others: some groups carry signal
    assert any(r["frac_zero_var"] < 1 for r in results)
    _check_outputs(out, report)


@pytest.mark.slow
def test_rank_over_a_run_directory(run_dir, run_report):
    out, report = run_report
    results = report["results"]
    # one result per (checkpoint, R), the starting model as step 0
    assert [(r["step"], r["R"]) for r in results] == [(s, R) for s in (0, 1, 2) for R in (2, 4)]
    assert {r["checkpoint"] for r in results if r["step"] == 0} == {"builtin"}
    assert {r["checkpoint"] for r in results if r["step"] == 2} == {str(run_dir / "checkpoints" / "step_2")}
    for res in results:
        _check_result(res)
    _check_outputs(out, report)


@pytest.mark.slow
def test_steps_selects_checkpoints_of_a_run_and_refuses_unknown_ones(run_dir, tmp_path):
    ckpts = run_targets(str(run_dir))
    assert [s for s, _ in select_steps(ckpts, (0, 2))] == [0, 2]
    assert select_steps(ckpts, ()) == ckpts
    with pytest.raises(ConfigError, match=r"--steps \[5\].*\[0, 1, 2\]"):
        select_steps(ckpts, (2, 5))
    report = run_rank(
        RankConfig(checkpoint=str(run_dir), steps=(2,), group_sizes=(2,), prompts=2, progress=False, out=str(tmp_path)),
        log=_quiet,
    )
    assert [(r["step"], r["R"]) for r in report["results"]] == [(2, 2)]


@pytest.mark.slow
def test_table_by_step_has_a_row_per_checkpoint_and_group_size(run_report):
    _, report = run_report
    lines = table_by_step(report["results"]).splitlines()
    assert len(lines) == 1 + len(report["results"])
    for line, res in zip(lines[1:], report["results"]):
        fields = line.split()
        assert fields[:3] == [str(res["step"]), str(res["R"]), f"{res['effective_rank']['n']}/3"]
        if res["effective_rank"]["n"] >= 2:
            assert f"[{res['effective_rank']['lo']:.2f}, {res['effective_rank']['hi']:.2f}]" in line


@pytest.mark.slow
def test_table1_has_a_line_per_group_size(run_report):
    _, report = run_report
    lines = table1(report["results"]).splitlines()
    assert len(lines) == 1 + 2
    assert "max rank" in lines[0] and "eff. rank" in lines[0]
    for line, R in zip(lines[1:], (2, 4)):
        fields = line.split()
        assert fields[0] == str(R) and fields[1] == str(R)  # R, then its largest possible rank
        rs = [r for r in report["results"] if r["R"] == R and r["effective_rank"]["mean"] is not None]
        if rs:  # the mean over steps of the per-step mean effective rank
            mean = sum(r["effective_rank"]["mean"] for r in rs) / len(rs)
            assert float(fields[2]) == pytest.approx(mean, abs=0.006)


def test_distinct_active_rollouts_counts_different_completions_with_nonzero_advantage():
    from grpolab.analysis.rank import distinct_active_rollouts
    from grpolab.common.batch import Batch

    ids = torch.tensor([[5, 6, 2, 0], [5, 6, 2, 0], [5, 7, 2, 0], [5, 6, 6, 2], [9, 2, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    # padding differs only outside the mask for rows 0 and 1: they are the same completion
    ids[1, 3] = 4
    b = Batch(torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1), ids, mask)
    assert distinct_active_rollouts(b, torch.tensor([0.5, 0.5, -0.2, 0.1, -0.9])) == 4
    assert distinct_active_rollouts(b, torch.tensor([0.5, 0.5, 0.0, 0.0, -1.0])) == 2  # zero advantage: no row
    assert distinct_active_rollouts(b, torch.zeros(5)) == 0


def test_table1_without_any_signal():
    empty = {"mean": None, "std": None, "min": None, "max": None}
    results = [{"R": 8, "step": 0, "effective_rank": empty, "top1_fraction": empty, "num_rank": empty}]
    lines = table1(results).splitlines()
    assert len(lines) == 2 and lines[1].split()[:2] == ["8", "8"] and "no prompt with reward variance" in lines[1]


# ---------------------------------------------------------------- CLI


@pytest.mark.slow
def test_cli_rank_smoke(tmp_path):
    out = tmp_path / "rank"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "COLUMNS": "200"}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpolab",
            "rank",
            "--checkpoint",
            "builtin",
            "--group-sizes",
            "2",
            "--prompts",
            "2",
            "--out",
            str(out),
            "--verify",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "gram_max_rel_err" in res.stdout
    report = json.loads((out / "rank.json").read_text())
    assert [(r["step"], r["R"]) for r in report["results"]] == [(0, 2)]
    assert report["results"][0]["gram_max_rel_err"] <= 1e-4
    for name in PLOTS:
        assert (out / name).is_file()


# ---------------------------------------------------------------- trainer probe


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe") / "run"
    train(
        TrainConfig(
            out=str(out),
            steps=2,
            prompts_per_step=2,
            group_size=4,
            eval_questions=8,
            eval_samples=1,
            progress=False,
            probe_every=1,
            probe_groups=2,
        ),
        log=_quiet,
    )
    rows = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert sorted(rows) == [0, 1, 2]
    probe = [json.loads(line) for line in (out / "probe.jsonl").read_text().splitlines()]
    for step in (1, 2):  # probe.jsonl: one line per measured group
        assert len([p for p in probe if p["step"] == step]) == rows[step]["probe/groups_measured"]
    return rows


@pytest.mark.slow
def test_trainer_logs_spectrum_probe(probed_run):
    G = 4
    for step in (1, 2):
        row = probed_run[step]
        live_groups = round(2 * (1 - row["reward/frac_zero_std"]))  # groups with reward variance
        assert row["probe/groups_measured"] == min(2, live_groups)
        for key in ("probe/eff_rank", "probe/top1_frac", "probe/num_rank"):
            assert key in row
            if live_groups == 0:
                assert row[key] is None, (step, key)
            else:
                assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (step, key, row[key])
        if live_groups:
            assert 1.0 - 1e-9 <= row["probe/eff_rank"] <= row["probe/num_rank"] <= G
            assert 1 / G - 1e-9 <= row["probe/top1_frac"] <= 1 + 1e-9
    assert any(probed_run[s]["probe/groups_measured"] > 0 for s in (1, 2))


@pytest.mark.slow
def test_trainer_logs_advantage_stats_every_step(probed_run):
    for step in (1, 2):
        row = probed_run[step]
        assert abs(row["probe/adv_max_abs_group_sum"]) < 1e-5
        assert math.isfinite(row["probe/adv_var_emp"]) and row["probe/adv_var_emp"] >= 0
        # the same fraction counted two ways (group size 4: no float32 std residue)
        assert row["probe/adv_frac_zero_var"] == pytest.approx(row["reward/frac_zero_std"])
        # with each group's sample variance as sigma^2 the pooled identity is exact (advantage_stats' note)
        assert row["probe/adv_var_emp"] == pytest.approx(row["probe/adv_var_theory"], rel=1e-5, abs=1e-9)
        assert row["probe/adv_cov_emp"] == pytest.approx(-row["probe/adv_var_emp"] / 3, rel=1e-5, abs=1e-9)


def test_trainer_advantage_stats_without_spectrum_probe(tmp_path):
    out = train(
        TrainConfig(
            out=str(tmp_path / "run"),
            steps=1,
            prompts_per_step=2,
            group_size=4,
            eval_questions=8,
            eval_samples=0,
            progress=False,
        ),
        log=_quiet,
    )  # probe_every = 0 (the default)
    row = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}[1]
    assert abs(row["probe/adv_max_abs_group_sum"]) < 1e-5 and "probe/adv_var_emp" in row
    assert "probe/eff_rank" not in row and "probe/groups_measured" not in row


# ---------------------------------------------------------------- one Gram pass, every estimator


def test_each_estimators_gram_equals_its_explicit_per_rollout_gradients():
    """rank --compare-estimators: each estimator's K = diag(A) Psi diag(A), from the one Gram pass, equals the Gram
    matrix of the per-rollout gradients A_i grad sum_t w_it log pi(o_it) computed one rollout at a time by autograd
    (float64, the built-in model), and the probe's spectrum metrics are those of that explicit matrix. grpo, grpo_std
    and rloo rescale the same centred rewards, so their scale-free metrics agree; vanilla's do not."""
    from grpolab.algo.loss import loss_token_mask
    from grpolab.analysis.rank import estimator_advantages, measure_prompt
    from grpolab.models.logprobs import completion_logprobs
    from grpolab.models.policy import load_policy
    from grpolab.probes.gram import score_gram, token_weights
    from grpolab.probes.spectrum import advantage_effective_rank, advantage_gram, spectrum_metrics
    from grpolab.rollout.sampler import sample

    policy = load_policy("builtin", dtype=torch.float64)
    model, R = policy.model.eval(), 6
    prompt = policy.prompt_ids({"question": "12+7-3"})
    batch = sample(model, [prompt] * R, [(5, i) for i in range(R)], max_new_tokens=10, temperature=1.0, top_p=1.0,
                   eos_id=policy.eos_id, pad_id=policy.pad_id)  # fmt: skip
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    estimators = ("vanilla", "grpo", "grpo_std", "rloo")
    cfg = RankConfig(max_new_tokens=10, compare_estimators=estimators, progress=False)
    row = measure_prompt(policy, lambda record, n, key: (batch, rewards, None), {}, R, (0,), cfg)
    weights = token_weights(batch.completion_mask, cfg.aggregation, cfg.max_new_tokens) * loss_token_mask(
        batch.completion_ids, batch.completion_mask, policy.eos_id, mask_truncated=False
    )
    psi = score_gram(model, batch, weights, temperature=cfg.temperature)
    params = [p for p in model.parameters() if p.requires_grad]
    scores = []  # psi_i, one backward each
    for i in range(R):
        logp = completion_logprobs(model, batch, cfg.temperature)[i]
        grads = torch.autograd.grad((logp * weights[i].to(logp.dtype)).sum(), params)
        scores.append(torch.cat([g.reshape(-1) for g in grads]))
    scores = torch.stack(scores)  # [R, D] float64
    spectra = {}
    for est, adv in estimator_advantages(rewards, estimators).items():
        g = adv.double()[:, None] * scores  # rows A_i psi_i
        explicit = g @ g.T
        K = advantage_gram(psi, adv)
        assert float((K - explicit).abs().max() / explicit.abs().max()) <= 1e-8, est
        spectra[est] = spectrum_metrics(torch.linalg.eigvalsh(explicit).clamp(min=0).sqrt())
        for key in ("effective_rank", "top1_fraction"):
            assert row["by_estimator"][est][key] == pytest.approx(spectra[est][key], rel=1e-8), (est, key)
        assert row["by_estimator"][est]["num_rank"] == spectra[est]["num_rank"]
    for est in ("grpo_std", "rloo"):  # positive multiples of grpo's advantages (each rounded to float32) in one group
        assert spectra[est]["effective_rank"] == pytest.approx(spectra["grpo"]["effective_rank"], rel=1e-6)
    assert abs(spectra["vanilla"]["effective_rank"] - spectra["grpo"]["effective_rank"]) > 1e-3
    assert row["effective_rank"] == pytest.approx(spectra["grpo"]["effective_rank"], rel=1e-8)  # --estimator grpo
    # the advantages' own effective rank: 4 R p (1 - p) for k = 2 of R = 6 correct
    assert row["adv_effective_rank"] == pytest.approx(4 * R * (2 / 6) * (4 / 6), rel=1e-6)  # float32 advantages
    assert advantage_effective_rank(torch.zeros(R)) == 0.0


def test_an_unknown_estimator_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="'oracle' is not one of vanilla, grpo, grpo_std, rloo"):
        run_rank(RankConfig(compare_estimators=("grpo", "oracle"), out=str(tmp_path), progress=False))


def test_a_groups_record_holds_its_halves_and_vanillas_spectra_as_explicit_matrices_give_them():
    """group_spectra from Psi alone against the explicit matrices of made-up score vectors x_i: G rows A_i x_i; each
    half a group of 4 with its own centred advantages; vanilla's rows r_i x_i."""
    from grpolab.probes.spectrum import spectrum_metrics
    from grpolab.training.observers import group_spectra

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 50, generator=gen, dtype=torch.float64)
    x[5] = x[1]  # two equal completions
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    adv = rewards - rewards.mean()

    def explicit(a, rows):
        return spectrum_metrics(torch.linalg.svdvals(a[:, None] * rows))

    rec = group_spectra(x @ x.T, adv, rewards, "grpo")
    # rel 1e-7: the Gram matrix's eigenvalues give its zero singular values as ~sqrt(eps) s_max (RANK_RTOL's note),
    # vanilla's five zero rows add ~1.6e-8 to its effective rank (seen on a CPU with AMX)
    for key in ("effective_rank", "top1_fraction", "num_rank"):
        assert rec[key] == pytest.approx(explicit(adv, x)[key], rel=1e-7)
        assert rec["vanilla"][key] == pytest.approx(explicit(rewards, x)[key], rel=1e-7)
        for h, block in zip(rec["halves"], (slice(0, 4), slice(4, 8))):
            r = rewards[block]
            assert h[key] == pytest.approx(explicit(r - r.mean(), x[block])[key], rel=1e-7)
    assert [h["reward_std"] for h in rec["halves"]] == [0.5, pytest.approx(0.4330127018922193)]
    assert rec["G"] == 8 and rec["reward_mean"] == 3 / 8
    assert rec["adv_effective_rank"] == pytest.approx(4 * 8 * (3 / 8) * (5 / 8))
