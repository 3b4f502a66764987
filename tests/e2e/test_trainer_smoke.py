"""Smoke tier: the GRPO trainer and the CLI end to end on the shipped built-in model.

Every run is a few steps of B=4 prompts x G=4 rollouts on the 0.5 M-parameter
warm start, a few seconds each on one CPU thread.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers.cli import run_cli
from helpers.paths import FIXTURES, REPO
from helpers.runs import by_step, quiet, small_cfg, state_dict
from transformers import AutoModelForCausalLM

from grpolab.config.train import ConfigError
from grpolab.models import checkpoint
from grpolab.models.policy import ASSET_DIR
from grpolab.training.recipe import build_trainer, run_training, saved_config, train
from grpolab.training.runlog import read_metrics
from grpolab.training.setup import checked_config

STEP_KEYS = {
    "step",
    "reward/mean",
    "reward/std",
    "reward/frac_zero_std",
    "reward/accuracy",
    "reward/format",
    "reward/errors",
    "loss/policy",
    "loss/kl",
    "loss/clip_frac",
    "grad/norm",
    "completion/len_mean",
    "time/generate_s",
    "time/update_s",
    "time/step_s",
}
EVAL_KEYS = {"eval/accuracy_greedy", "eval/accuracy_sampled"}
CKPT_FILES = {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "trainer_state.json"}


def _assert_finite(row: dict, allow_null=()):
    for k, v in row.items():
        if k in allow_null and v is None:
            continue
        assert isinstance(v, (int, float)) and math.isfinite(v), (row["step"], k, v)


# ---------------------------------------------------------------- a basic run


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "run"
    cfg = small_cfg(out, steps=3, save_every=2, warmup_steps=0)
    assert train(cfg, log=quiet) == out
    return cfg, out


@pytest.mark.slow
def test_run_dir_holds_the_whole_config(base_run):
    cfg, out = base_run
    saved = json.loads((out / "config.json").read_text())
    # every option by its name (tuples -> lists); the options resolved at start as they resolved: the built-in model
    # trains in fp32 (auto) and samples in fp32 on its own weights, an exact engine, so no correction
    resolved = checked_config(cfg).replace(precision="32-true", rollout_dtype="float32", engine_correction="none")
    expected = json.loads(json.dumps(resolved.to_dict()))
    assert {k: v for k, v in saved.items() if k not in ("code_version", "world_size")} == expected
    assert (
        cfg.reward.format_weight is None and saved["format_weight"] == 0.1
    )  # model-dependent defaults recorded as used
    assert "code_version" in saved
    assert saved["world_size"] == 1  # processes the run was started on


@pytest.mark.slow
def test_metrics_have_one_row_per_step_and_the_documented_keys(base_run):
    _, out = base_run
    rows = by_step(read_metrics(out / "metrics.jsonl"))
    assert sorted(rows) == [0, 1, 2, 3]
    assert EVAL_KEYS <= rows[0].keys()  # the step-0 evaluation
    for step in (1, 2, 3):
        missing = STEP_KEYS - rows[step].keys()
        assert not missing, (step, missing)
        assert rows[step]["loss/kl"] is None  # beta = 0: no reference, no KL
    assert EVAL_KEYS <= rows[3].keys()  # the last step is evaluated
    assert not EVAL_KEYS & rows[1].keys() and not EVAL_KEYS & rows[2].keys()  # eval_every=50: not in between
    for row in rows.values():
        _assert_finite(row, allow_null=("loss/kl",))


@pytest.mark.slow
def test_metric_values_are_consistent(base_run):
    _, out = base_run
    rows = by_step(read_metrics(out / "metrics.jsonl"))
    for step in (1, 2, 3):
        r = rows[step]
        # r = accuracy + 0.1 * format for every rollout, so the same holds for the means
        assert r["reward/mean"] == pytest.approx(r["reward/accuracy"] + 0.1 * r["reward/format"], abs=1e-6)
        for key in ("reward/accuracy", "reward/format", "reward/frac_zero_std", "loss/clip_frac"):
            assert 0.0 <= r[key] <= 1.0, key
        assert r["reward/errors"] == 0
        assert 1 <= r["completion/len_mean"] <= 48
        assert r["grad/norm"] >= 0
        assert r["time/step_s"] >= r["time/generate_s"] + r["time/update_s"] - 1e-6
    for row in (rows[0], rows[3]):
        for key in EVAL_KEYS:
            assert 0.0 <= row[key] <= 1.0
    assert any(rows[s]["reward/frac_zero_std"] < 1 for s in (1, 2, 3))  # some learning signal


@pytest.mark.slow
def test_samples_are_logged_at_evaluations(base_run):
    _, out = base_run
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {(r["step"], r["kind"]) for r in rows} == {(0, "eval"), (3, "eval"), (3, "train")}
    assert all(isinstance(r["completion"], str) for r in rows)


@pytest.mark.slow
def test_checkpoints_are_complete(base_run):
    _, out = base_run
    found = checkpoint.checkpoint_dirs(out)
    assert [s for s, _ in found] == [2, 3]  # save_every=2, and the last step
    for step, path in found:
        assert path == out / "checkpoints" / f"step_{step}"
        assert CKPT_FILES <= {p.name for p in path.iterdir()}
        assert json.loads((path / "trainer_state.json").read_text())["step"] == step


@pytest.mark.slow
def test_parameters_changed(base_run):
    _, out = base_run
    start = state_dict(ASSET_DIR)
    trained = state_dict(out / "checkpoints" / "step_3")
    assert start.keys() == trained.keys()
    changed = [k for k in start if not torch.equal(start[k], trained[k])]
    assert changed, "no parameter changed in 3 GRPO steps"
    assert all(torch.isfinite(v).all() for v in trained.values())


@pytest.mark.slow
def test_new_run_in_a_used_directory_without_resume_raises(base_run):
    _, out = base_run
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="--resume"):
        train(small_cfg(out, steps=3), log=quiet)
    assert (out / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_resume_with_a_different_seed_raises(base_run):
    _, out = base_run
    with pytest.raises(ConfigError, match="--seed"):
        train(small_cfg(out, steps=4, seed=1, resume=True), log=quiet)


# ---------------------------------------------------------------- KL, mu > 1, micro-batches


@pytest.mark.slow
def test_kl_penalty_run(tmp_path):
    out = train(
        small_cfg(tmp_path / "kl", steps=2, beta=0.04, micro_batch=4, warmup_steps=0, save_every=1, keep_checkpoints=1),
        log=quiet,
    )
    assert [s for s, _ in checkpoint.checkpoint_dirs(out)] == [2]  # keep_checkpoints=1: only the newest
    rows = by_step(read_metrics(out / "metrics.jsonl"))
    for step in (1, 2):
        _assert_finite(rows[step])
        assert rows[step]["loss/kl"] >= 0
    # At step 1 the policy is the reference (the same weights), so every k3 term is
    # exp(0) - 0 - 1 = 0; after an update with signal it is positive.
    assert rows[1]["loss/kl"] == pytest.approx(0.0, abs=1e-7)
    assert rows[1]["reward/frac_zero_std"] < 1
    assert rows[2]["loss/kl"] > 0


@pytest.mark.slow
def test_several_updates_per_batch(tmp_path):
    out = train(small_cfg(tmp_path / "mu", steps=2, mu=2, warmup_steps=0, lr=1e-3), log=quiet)
    rows = by_step(read_metrics(out / "metrics.jsonl"))
    for step in (1, 2):
        _assert_finite(rows[step], allow_null=("loss/kl",))
        assert rows[step]["loss/ratio_mean"] > 0
    # the second update sees the policy moved by the first, so the ratio is no longer exactly 1
    assert any(rows[s]["loss/ratio_mean"] != 1.0 for s in (1, 2))


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.slow
def test_micro_batching_does_not_change_the_first_update(tmp_path, aggregation):
    # Step 1 samples with the same weights and keys in both runs; its loss and gradient norm are
    # computed on the same rollouts, whole (micro_batch=0) or 4 rollouts at a time.
    rows = {}
    for mb in (0, 4):
        out = train(
            small_cfg(tmp_path / f"mb{mb}", steps=1, micro_batch=mb, aggregation=aggregation, eval_samples=0), log=quiet
        )
        rows[mb] = by_step(read_metrics(out / "metrics.jsonl"))[1]
    assert rows[0]["reward/mean"] == rows[4]["reward/mean"]
    assert rows[0]["loss/active_frac"] > 0
    assert rows[4]["loss/policy"] == pytest.approx(rows[0]["loss/policy"], abs=1e-6)
    assert rows[4]["grad/norm"] == pytest.approx(rows[0]["grad/norm"], rel=1e-4)
    assert rows[0]["grad/norm"] > 0


@pytest.mark.slow
def test_jsonl_training_and_eval_data(tmp_path):
    fixtures = FIXTURES
    logs = []
    out = train(
        small_cfg(
            tmp_path / "jsonl",
            steps=1,
            data=str(fixtures / "gsm8k_small.jsonl"),
            eval_data=str(fixtures / "gsm8k_eval_small.jsonl"),
        ),
        log=logs.append,
    )
    # one training question ("Sam reads 12 pages ...") is also an eval question: dropped, with a warning
    assert any("1 training record(s)" in str(m) for m in logs), logs
    rows = by_step(read_metrics(out / "metrics.jsonl"))
    assert sorted(rows) == [0, 1]
    _assert_finite(rows[1], allow_null=("loss/kl",))
    evals = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {r["question"] for r in evals if r["kind"] == "eval"} <= {
        "Ann has 6 pears and eats 2. How many are left?",
        "Sam reads 12 pages a day. How many pages in a week?",
        "A box holds 9 eggs. How many eggs are in 3 boxes?",
    }


def test_training_data_entirely_held_out_is_refused_at_start(tmp_path):
    # Training on the eval file leaves no training record once held-out questions are dropped;
    # that must be a clear error at start (ConfigError/DataError, which the CLI reports in one line),
    # not a crash inside step 1 after the step-0 evaluation has been written.
    from grpolab.data import DataError

    data = str(FIXTURES / "gsm8k_eval_small.jsonl")
    out = tmp_path / "leak"
    with pytest.raises((ConfigError, DataError)):
        train(small_cfg(out, steps=1, data=data, eval_data=data), log=quiet)
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()


# ---------------------------------------------------------------- resume and crash safety


def _without_time(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("time/")}


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, beta):
    # warmup_steps=5 keeps steps 4-5 in the warm-up, so the scheduler state must be restored too;
    # with beta > 0 the resumed run's reference must be the starting model, not the checkpoint.
    common = dict(save_every=3, warmup_steps=5, lr=1e-3, beta=beta)
    a = train(small_cfg(tmp_path / "A", steps=6, **common), log=quiet)
    b = train(small_cfg(tmp_path / "B", steps=3, **common), log=quiet)
    assert [s for s, _ in checkpoint.checkpoint_dirs(b)] == [3]
    logs = []
    train(small_cfg(tmp_path / "B", steps=6, resume=True, **common), log=logs.append)
    assert any("from step 3" in str(m) for m in logs), logs
    rows_a = by_step(read_metrics(a / "metrics.jsonl"))
    rows_b = by_step(read_metrics(b / "metrics.jsonl"))
    assert sorted(rows_a) == sorted(rows_b) == list(range(7))
    for step in (4, 5, 6):
        assert _without_time(rows_b[step]) == _without_time(rows_a[step]), step
    assert rows_a[4]["charts/lr"] == pytest.approx(1e-3 * 4 / 5)  # linear warm-up: lr * 4/5 at step 4
    # the final weights agree too
    sa, sb = state_dict(a / "checkpoints" / "step_6"), state_dict(b / "checkpoints" / "step_6")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow
def test_incomplete_checkpoints_are_ignored_and_resume_uses_the_last_complete_one(tmp_path):
    out = train(small_cfg(tmp_path / "C", steps=2, save_every=1), log=quiet)
    ckpts = out / "checkpoints"
    # a run killed while writing step 6 (temporary dir) and a step_9 without its completion marker
    (ckpts / ".tmp_step_6").mkdir()
    (ckpts / ".tmp_step_6" / "model.safetensors").write_bytes(b"\x00partial")
    (ckpts / "step_9").mkdir()
    (ckpts / "step_9" / "model.safetensors").write_bytes(b"\x00partial")
    (ckpts / "step_9" / "optimizer.pt").write_bytes(b"\x00partial")
    assert [s for s, _ in checkpoint.checkpoint_dirs(out)] == [1, 2]

    logs = []
    train(small_cfg(out, steps=3, save_every=1, resume=True), log=logs.append)
    assert any("from step 2" in str(m) for m in logs), logs
    rows = by_step(read_metrics(out / "metrics.jsonl"))
    assert sorted(rows) == [0, 1, 2, 3]
    assert [s for s, _ in checkpoint.checkpoint_dirs(out)] == [1, 2, 3]
    assert not (ckpts / ".tmp_step_6").exists()  # stale temporary directories are cleaned on the next save


@pytest.mark.slow
def test_a_resumed_run_keeps_the_rollout_dtype_and_correction_it_resolved_at_start(tmp_path):
    out = train(small_cfg(tmp_path / "R", steps=2, save_every=1), log=quiet)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["rollout_dtype"], saved["engine_correction"]) == ("float32", "none")  # auto, as resolved
    # left on auto, the resumed run continues with the recorded values; another value is another run
    recipe = run_training(small_cfg(out, steps=3, resume=True), log=quiet)
    assert (recipe.cfg.engine.rollout_dtype, recipe.cfg.objective.engine_correction) == ("float32", "none")
    with pytest.raises(ConfigError, match="--engine-correction is 'token-mask' but the run was started with 'none'"):
        train(small_cfg(out, steps=4, resume=True, engine_correction="token-mask"), log=quiet)
    # a run recorded before these options existed sampled with the policy itself and corrected nothing
    (out / "config.json").write_text(
        json.dumps({k: v for k, v in saved.items() if k not in ("rollout_dtype", "engine_correction")})
    )
    before = saved_config(out)
    assert (before.engine.rollout_dtype, before.objective.engine_correction) == ("auto", "none")


def test_resume_without_a_checkpoint_raises(tmp_path):
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        train(small_cfg(tmp_path / "empty", steps=2, resume=True), log=quiet)


# ---------------------------------------------------------------- reward functions


@pytest.mark.slow
def test_a_reward_function_that_always_raises_does_not_crash_the_run(tmp_path):
    out = train(small_cfg(tmp_path / "err", steps=1, reward_fn=("reward_fixtures:always_raises",)), log=quiet)
    row = by_step(read_metrics(out / "metrics.jsonl"))[1]
    # each of the B*G = 16 rollouts fails the accuracy function once (batch call, then its own call)
    assert row["reward/errors"] == 16
    assert row["reward/accuracy"] == 0.0
    assert row["reward/mean"] == pytest.approx(0.1 * row["reward/format"], abs=1e-6)
    _assert_finite(row, allow_null=("loss/kl",))


@pytest.mark.slow
def test_a_constant_reward_gives_no_update(tmp_path):
    # Every rollout earns 0.1 (a constant accuracy function, format weight 0): every group has
    # zero reward variance, so every advantage is 0, no rollout is active, the gradient is 0 and
    # AdamW leaves the weights exactly where they were.
    out = train(
        small_cfg(
            tmp_path / "const",
            steps=1,
            prompts_per_step=2,
            group_size=8,
            format_weight=0.0,
            warmup_steps=0,
            reward_fn=("reward_fixtures:constant_tenth",),
        ),
        log=quiet,
    )
    row = by_step(read_metrics(out / "metrics.jsonl"))[1]
    assert row["reward/mean"] == pytest.approx(0.1)
    assert row["reward/frac_zero_std"] == 1.0
    assert row["loss/active_frac"] == 0.0
    assert row["grad/norm"] == 0.0
    start, trained = state_dict(ASSET_DIR), state_dict(out / "checkpoints" / "step_1")
    moved = [k for k in start if not torch.equal(start[k], trained[k])]
    assert not moved, f"{len(moved)} tensors moved without any learning signal, e.g. {moved[:3]}"


@pytest.mark.slow
def test_one_step_with_a_trl_style_function_and_two_weighted_functions(tmp_path):
    example = str(REPO / "examples" / "trl_reward.py")
    # TRL-style alone: it replaces the accuracy reward, so reward/accuracy is its mean
    out = train(small_cfg(tmp_path / "trl", steps=1, reward_fn=(f"{example}:correct",)), log=quiet)
    row = by_step(read_metrics(out / "metrics.jsonl"))[1]
    assert row["reward/errors"] == 0 and row["reward/correct"] == row["reward/accuracy"]
    assert row["reward/mean"] == pytest.approx(row["reward/correct"] + 0.1 * row["reward/format"], abs=1e-6)
    # two weighted functions through the CLI (the TRL one and a grpolab-form one): each logged, summed by weight
    run_cli(
        [
            "train",
            "--steps",
            "1",
            "--prompts-per-step",
            "4",
            "--group-size",
            "4",
            "--eval-questions",
            "8",
            "--eval-samples",
            "1",
            "--max-new-tokens",
            "48",
            "--threads",
            "1",
            "--out",
            "two",
            "--log-rollouts",
            "--reward-fn",
            f"{example}:concise",
            "--reward-fn",
            "grpolab.rewards:accuracy_reward",
            "--reward-weights",
            "0.5,2",
        ],
        tmp_path,
    )
    row = by_step(read_metrics(tmp_path / "two" / "metrics.jsonl"))[1]
    assert row["reward/errors"] == 0 and 0 < row["reward/concise"] < 1
    assert row["reward/accuracy"] == row["reward/concise"]  # the first function plays the accuracy part
    acc = row["reward/accuracy_reward"]
    assert row["reward/mean"] == pytest.approx(
        0.5 * row["reward/concise"] + 2 * acc + 0.1 * row["reward/format"], abs=1e-6
    )
    # per rollout, recomputed here from the logged completions and the task's ground truth
    from grpolab.rewards.builtin import accuracy_reward, format_reward

    rolls = [json.loads(line) for line in (tmp_path / "two" / "rollouts.jsonl").read_text().splitlines()]
    rolls = [r for entry in rolls for r in (entry["rollouts"] if "rollouts" in entry else [entry])]
    assert len(rolls) == 16
    for r in rolls:
        c, truth = r["completion"], eval(r["question"])  # the built-in task's questions are Python arithmetic
        truth = str(int(truth)) if float(truth).is_integer() else str(truth)
        acc = accuracy_reward([c], [{"ground_truth": truth}])[0]
        expected = 0.5 * max(0.0, 1 - len(c) / 200) + 2 * acc + 0.1 * format_reward([c], [{}])[0]
        assert r["reward"] == pytest.approx(expected, abs=1e-5)


# ---------------------------------------------------------------- CLI


@pytest.mark.slow
def test_cli_train_end_to_end(tmp_path):
    out = tmp_path / "cli"
    res = run_cli(
        [
            "train",
            "--out",
            str(out),
            "--steps",
            "2",
            "--prompts-per-step",
            "4",
            "--group-size",
            "4",
            "--eval-questions",
            "16",
            "--eval-samples",
            "2",
            "--max-new-tokens",
            "48",
            "--no-progress",
        ],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(by_step(read_metrics(out / "metrics.jsonl"))) == [0, 1, 2]
    assert json.loads((out / "config.json").read_text())["steps"] == 2
    assert [s for s, _ in checkpoint.checkpoint_dirs(out)] == [2]


@pytest.mark.slow
def test_cli_demo_help(tmp_path):
    res = run_cli(["demo", "--help"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "--steps" in res.stdout


@pytest.mark.slow
def test_cli_plot_redraws_the_plot(base_run, tmp_path, capsys):
    from grpolab.commands.cli import main

    _, out = base_run
    png = out / "plot.png"
    png.unlink(missing_ok=True)
    main(["plot", str(out)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sft_smoke(tmp_path):
    from grpolab.models.builtin import TinyLlamaSpec
    from grpolab.training.sft import SFTConfig, run_sft

    out = tmp_path / "sft"
    cfg = SFTConfig(
        out=str(out),
        steps=3,
        batch_size=4,
        warmup_steps=1,
        eval_questions=8,
        eval_samples=1,
        model=TinyLlamaSpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
        progress=False,
    )
    metrics = run_sft(cfg)
    assert 0.0 <= metrics["eval/accuracy_greedy"] <= 1.0 and 0.0 <= metrics["eval/accuracy_sampled"] <= 1.0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.hidden_size == 32
    rows = [json.loads(line) for line in (out / "sft_metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 3 and math.isfinite(rows[-1]["loss/sft"])


def test_update_normalises_by_the_rows_it_is_given(tmp_path):
    """An episode of an environment that shows each turn alone is several token rows: the loss's normaliser is the
    number of rows given (summed over ranks), whatever the config's B * G."""
    from grpolab.algo.loss import policy_loss
    from grpolab.models.logprobs import completion_logprobs
    from grpolab.rollout.sampler import sample

    trainer = build_trainer(small_cfg(tmp_path / "u", steps=1, warmup_steps=0), log=quiet)
    cfg, policy = trainer.cfg, trainer.policy
    prompts = [
        policy.prompt_ids(r) for r in trainer.task_stage.sampler.draw(1, 3) for _ in range(4)
    ]  # 12 rows; B * G = 16
    batch = sample(
        policy.model,
        prompts,
        [(7, i) for i in range(12)],
        max_new_tokens=cfg.generation.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        eos_id=policy.eos_id,
        pad_id=policy.pad_id,
    )
    adv = torch.linspace(-1.0, 1.0, 12)
    with torch.no_grad():
        logp = completion_logprobs(policy.model, batch)
    expected, _ = policy_loss(
        logp,
        logp,
        adv,
        batch.completion_mask,
        aggregation=cfg.objective.aggregation,
        max_len=cfg.generation.max_new_tokens,
    )
    assert trainer.update_stage.updater(batch, adv)["loss/total"] == pytest.approx(expected.item(), rel=1e-5)


def test_few_shot_prompts_on_the_built_in_task(tmp_path):

    trainer = build_trainer(small_cfg(tmp_path / "fs", steps=1, few_shot=2), log=quiet)
    shots = trainer.policy.few_shot
    assert len(shots) == 2 and all(s["answer"].rstrip().split("\n")[-1].startswith("####") for s in shots)
    test_q = {r["question"] for r in trainer.task_stage.held_out}
    assert not test_q & {s["question"] for s in shots}  # examples come from the training split
    prompt = trainer.policy.tokenizer.decode(trainer.policy.prompt_ids({"question": "1+2"}), skip_special_tokens=True)
    assert prompt.startswith(shots[0]["question"] + "\n") and prompt.endswith("1+2\n")
    assert math.isfinite(trainer.step(1).metrics["loss/total"])
