"""The loss variants through the trainer on the shipped built-in model: what each changes in a real step,
and where it must change nothing."""

from __future__ import annotations

import pytest
import torch
from helpers.runs import metrics_by_step, quiet, small_cfg, state_dict

from grpolab.algo.loss import entropy_threshold, loss_token_mask
from grpolab.config.train import ConfigError
from grpolab.models.policy import ASSET_DIR
from grpolab.training.recipe import train

TIMING = ("time/",)


@pytest.mark.slow
def test_scale_rewards_none_is_the_group_mean_estimator(tmp_path):
    a = train(small_cfg(tmp_path / "none", steps=2, estimator="grpo_std", scale_rewards="none"), log=quiet)
    b = train(small_cfg(tmp_path / "grpo", steps=2, estimator="grpo"), log=quiet)
    assert metrics_by_step(a) == metrics_by_step(b)


@pytest.mark.slow
def test_scale_rewards_batch_moves_the_weights_differently(tmp_path):
    a = train(small_cfg(tmp_path / "batch", steps=1, scale_rewards="batch"), log=quiet)
    b = train(small_cfg(tmp_path / "group", steps=1), log=quiet)
    ma, mb = metrics_by_step(a)[1], metrics_by_step(b)[1]
    assert ma["reward/mean"] == mb["reward/mean"] and ma["grad/norm"] != mb["grad/norm"]


@pytest.mark.slow
def test_sequence_ratios_at_mu_1_give_the_token_level_update(tmp_path):
    """mu = 1: every ratio is 1, where GSPO's gradient equals GRPO's (tests/algo/test_loss_variants.py)."""
    a = train(small_cfg(tmp_path / "seq", steps=1, importance_sampling="sequence"), log=quiet)
    b = train(small_cfg(tmp_path / "tok", steps=1), log=quiet)
    assert metrics_by_step(a)[1]["grad/norm"] == pytest.approx(metrics_by_step(b)[1]["grad/norm"], rel=1e-5)
    sa, sb = state_dict(a / "checkpoints" / "step_1"), state_dict(b / "checkpoints" / "step_1")
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-7)


def test_mask_truncated_with_every_completion_cut_leaves_the_weights(tmp_path):
    # three new tokens: no completion of the warm start ends that soon, so every one is truncated and carries no loss
    # temperature 3 and a reward of the characters: rollouts differ, so nearly every group has reward variance
    dense = dict(reward_fn=("reward_fixtures:odd_code_sum",), format_weight=0.0, temperature=3.0)
    out = train(
        small_cfg(tmp_path / "cut", steps=1, max_new_tokens=3, mask_truncated=True, warmup_steps=0, **dense), log=quiet
    )
    row = metrics_by_step(out)[1]
    assert row["completion/truncated_frac"] == 1.0 and row["loss/active_frac"] == 0.0 and row["grad/norm"] == 0.0
    assert row["reward/std"] > 0  # rewards are still computed, and they vary
    start, trained = state_dict(ASSET_DIR), state_dict(out / "checkpoints" / "step_1")
    assert all(torch.equal(start[k], trained[k]) for k in start)
    # without the flag the same rollouts do move the weights
    moved = train(small_cfg(tmp_path / "kept", steps=1, max_new_tokens=3, warmup_steps=0, **dense), log=quiet)
    assert metrics_by_step(moved)[1]["grad/norm"] > 0


@pytest.mark.slow
def test_overlong_penalty_joins_the_reward_and_is_logged(tmp_path):
    out = train(
        small_cfg(tmp_path / "long", steps=1, max_new_tokens=24, overlong_buffer=8, overlong_penalty=0.5), log=quiet
    )
    row = metrics_by_step(out)[1]
    assert -0.5 <= row["reward/overlong"] < 0
    assert row["reward/mean"] == pytest.approx(
        row["reward/accuracy"] + 0.1 * row["reward/format"] + row["reward/overlong"], abs=1e-6
    )


@pytest.mark.slow
def test_entropy_is_logged_and_top_entropy_quantile_one_changes_nothing(tmp_path):
    a = train(small_cfg(tmp_path / "q1", steps=2, top_entropy_quantile=1.0), log=quiet)
    b = train(small_cfg(tmp_path / "plain", steps=2), log=quiet)
    assert metrics_by_step(a) == metrics_by_step(b)
    assert all(0 < r["policy/entropy"] < 5 for s, r in metrics_by_step(a).items() if s > 0)
    c = train(small_cfg(tmp_path / "q02", steps=1, top_entropy_quantile=0.2), log=quiet)
    assert metrics_by_step(c)[1]["grad/norm"] != metrics_by_step(b)[1]["grad/norm"]


def test_loss_token_mask_by_hand():
    eos = 9
    ids = torch.tensor([[1, 2, 9, 0], [1, 2, 3, 4], [5, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    ent = torch.tensor([[0.1, 0.9, 0.2, 0.0], [0.8, 0.7, 0.6, 0.5], [0.3, 0.4, 0.0, 0.0]])
    assert loss_token_mask(ids, mask, eos).tolist() == mask.double().tolist()
    assert loss_token_mask(ids, mask, eos, mask_truncated=True)[1].sum() == 0  # row 1 has no EOS
    # threshold over the 5 tokens left (0.1, 0.9, 0.2, 0.3, 0.4): the top 40 %
    th = float(entropy_threshold(torch.tensor([0.1, 0.9, 0.2, 0.3, 0.4]), 0.4))
    got = loss_token_mask(ids, mask, eos, mask_truncated=True, entropy=ent, top_entropy_quantile=0.4)
    assert got.tolist() == [[0, 1, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0]] and 0.3 < th <= 0.4


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(scale_rewards="batch", estimator="rloo"), "--scale-rewards"),
        (dict(clip_delta=1.1), "--clip-delta"),
        (dict(top_entropy_quantile=0.0), "--top-entropy-quantile"),
        (dict(overlong_buffer=48), "--overlong-buffer"),
    ],
)
def test_invalid_variant_settings_are_refused(tmp_path, over, message):
    with pytest.raises(ConfigError, match=message):
        small_cfg(tmp_path / "x", **over).validate()


# ---------------------------------------------------------------- dropout


@pytest.mark.parametrize("keep_dropout", [False, True])
@pytest.mark.slow
def test_dropout_is_off_in_training_unless_kept(gpt2_with_dropout, tmp_path, keep_dropout):
    """Every advantage 0 (a constant reward) and a KL term at step 1, where the policy is the reference: the KL
    gradient is exactly 0, so the whole gradient is 0, unless dropout makes the trainer's distribution another."""
    cfg = small_cfg(
        tmp_path / "run", model=gpt2_with_dropout, steps=1, beta=0.04, keep_dropout=keep_dropout, eval_samples=0,
        reward_fn=("reward_fixtures:constant_tenth",), shared_prefix="off",
    )  # fmt: skip
    norm = metrics_by_step(train(cfg, log=quiet))[1]["grad/norm"]
    assert (norm > 1e-4) if keep_dropout else (norm < 1e-6), norm
