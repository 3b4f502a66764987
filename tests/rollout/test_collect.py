"""The rollout-engine seam: the collector, and the trainer around it, driven by an engine written here.

``ScriptedEngine`` is a real rollout engine, not a mock of the model: it returns completions chosen by
each row's rollout key (even rollouts answer right, odd ones wrong), with per-token log-probs and
entropies, exactly as the :class:`grpolab.rollout.engine.RolloutEngine` contract asks. The tests check what
the collector makes of it: the keys it asks for, the groups, texts and rewards it returns, the
filter mode's rounds, and a trainer step that updates on its rollouts and tells it the weights changed.
"""

from __future__ import annotations

import pytest
import torch
from helpers.engines import RIGHT, WRONG, ScriptedEngine

from grpolab.common import streams
from grpolab.models.policy import Policy
from grpolab.rewards.builtin import default_reward_fns
from grpolab.rewards.rewarder import Rewarder
from grpolab.rollout.collect import Collector, CollectSettings
from grpolab.rollout.engine import SamplingSettings
from grpolab.rollout.service import RolloutService
from grpolab.training.recipe import build_trainer


class Records:
    """A task sampler: every question's answer is 7."""

    def draw(self, step: int, n: int, round: int = 0) -> list[dict]:
        return [{"question": f"{step}.{round}.{i}+0", "ground_truth": "7"} for i in range(n)]


@pytest.fixture()
def policy(tiny_model, char_tokenizer):
    return Policy(tiny_model, char_tokenizer, "tiny")


def _collector(policy, engine, mode="fixed", B=2, G=4, rounds=3) -> Collector:
    settings = CollectSettings(mode, B, G, seed=5, sampling=SamplingSettings(8, 0.7), max_sampling_rounds=rounds)
    return Collector(RolloutService(engine, policy, Rewarder(default_reward_fns(0.1))), Records(), settings)


def test_the_collector_runs_on_an_engine_it_is_given(policy, char_tokenizer):
    engine = ScriptedEngine(char_tokenizer)
    roll = _collector(policy, engine).collect(step=3)

    # The engine was asked once, for B * G rows keyed (ROLLOUT, seed, step, prompt, rollout), with the settings.
    ((prompts, keys, settings),) = engine.calls
    assert keys == [(streams.ROLLOUT, 5, 3, b, g) for b in range(2) for g in range(4)]
    assert settings == SamplingSettings(8, 0.7)
    assert prompts == [policy.prompt_ids(r) for r in Records().draw(3, 2) for _ in range(4)]
    # Groups, texts and rewards follow from the engine's completions: accuracy + 0.1 * format.
    rows = roll.groups.rows
    assert roll.groups.prompt == [0, 1] and roll.groups.sizes == [4, 4] and roll.prompts == [0, 1]
    assert rows.texts == [RIGHT, WRONG, RIGHT, WRONG] * 2
    torch.testing.assert_close(rows.scores.total, torch.tensor([1.1, 0.1, 1.1, 0.1] * 2))
    assert roll.rewards == [pytest.approx([1.1, 0.1, 1.1, 0.1])] * 2
    # What the sampler saw comes back aligned with the rows (0 on padding).
    torch.testing.assert_close(rows.logprobs, -0.5 * rows.batch.completion_mask.float())
    torch.testing.assert_close(rows.entropy, 1.5 * rows.batch.completion_mask.float())
    assert roll.generated.length == [7] * 8 and roll.generated.truncated == [False] * 8


def test_filter_draws_more_rounds_until_groups_vary(policy, char_tokenizer):
    # Every rollout right: no group has reward variance, so filter draws every round it may and keeps none.
    engine = ScriptedEngine(char_tokenizer, answers=(RIGHT,))
    roll = _collector(policy, engine, mode="filter", rounds=3).collect(step=1)
    assert roll.rounds == 3 and roll.short and roll.rewards == [] and roll.groups.sizes == []
    assert [k[3] for k in engine.calls[1][1][::4]] == [2, 3]  # round 2 numbers its prompts after round 1's
    assert roll.generated.zero_std == 1.0


def test_a_trainer_step_updates_on_the_engines_rollouts(tmp_path, char_tokenizer):
    from grpolab.config.train import TrainConfig

    cfg = TrainConfig(
        out=str(tmp_path), prompts_per_step=2, group_size=4, eval_questions=1, log_rollouts=True, warmup_steps=0
    )
    engine = ScriptedEngine(char_tokenizer)
    trainer = build_trainer(cfg, log=lambda *a: None, engine=engine)  # the seam: any engine stands in for the sampler
    assert trainer.policy.tokenizer.get_vocab() == char_tokenizer.get_vocab()  # the built-in model's tokenizer
    trainer.sampling_stage.collector.sampler = (
        Records()
    )  # questions whose answer is 7, so that half the rollouts are right
    before = [p.detach().clone() for p in trainer.policy.model.parameters()]
    out = trainer.step(1)
    assert len(engine.calls) == 1 and engine.weight_updates == 1
    assert [r["completion"] for r in out.rollouts] == [RIGHT, WRONG, RIGHT, WRONG] * 2
    # grpo_std advantages of rewards (1.1, 0.1, 1.1, 0.1): +-1 (up to the std's epsilon), and the weights moved
    assert [round(r["advantage"], 3) for r in out.rollouts] == [1.0, -1.0, 1.0, -1.0] * 2
    assert out.metrics["reward/accuracy"] == 0.5 and out.metrics["loss/active_frac"] == 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.model.parameters()))
